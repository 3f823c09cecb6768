# Sourced first in a device call (`source benchmarks/device/setup.sh; ...`), from the repo root, carrying `.whl`,
# filled here first (session 36; the lock's transformers and hub: the image's 5.17 fails the fallback's VLMs):
#   ../shared/device/wheelhouse.sh quicktok-v1 xgrammar apache-tvm-ffi jsonschema jsonschema-specifications referencing \
#     rpds-py attrs httptools uvloop pillow peft accelerate psutil opentelemetry-api==1.45.2 annotated-doc lazy-importer \
#     opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common zipp protobuf transformers==5.25.0 \
#     huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 kernels==0.19.1 hf-xet==1.8.0 httpx2==2.16.2 \
#     httpcore2==2.16.2 regex tomlkit typer truststore rich shellingham markdown-it-py mdurl pygments pybase64==1.5.1
# (versions as requirements/runtime.txt pins them, or as a dependent in the folder names them). It puts
# the wheels into /tmp/site, the repo and them first on the path, then an import check that fails the call in
# seconds where a wheel is missing (check the folder here first: `python -m benchmarks.device.wheels`).
# Writes the GPU, driver and time to $OUT/gpu.txt; `left N` prints N minus the seconds since this ran.
# A script started from one that sourced it (queue.sh -> side_by_side.sh) finds it done and skips the install.
if [ -z "${DEVICE_SETUP_DONE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 |
    grep -v "already exists" | tail -3
  export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
  python3 -c "import huggingface_hub.hf_api, transformers, xgrammar, pybase64, tgi_compat.router.engine" ||
    { echo "import check failed: a wheel is missing from .whl"; exit 3; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt"
  date -u >> "$OUT/gpu.txt"
  export DEVICE_SETUP_DONE=1
fi
_setup_t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - _setup_t0) )); }
