# TGI-compatible server image: same entrypoint, port and cache conventions as
# ghcr.io/huggingface/text-generation-inference (docs/contract.md §13).
#   docker build -t tgi-compat .
#   docker run --gpus all --shm-size 1g -p 8080:80 -v $PWD/data:/data tgi-compat --model-id <id>
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE}

# Python 3.12 (Ubuntu 24.04's); Triton compiles its small launcher stubs at run time, so it needs
# a C compiler and the Python headers even in a runtime image.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /usr/src/tgi-compat
COPY docker/install.sh docker/install.sh
COPY pyproject.toml README.md ./
COPY requirements requirements
COPY tgi_compat tgi_compat
COPY benchmarks benchmarks

# Same steps as `make install` (docker/install.sh); torch==2.13.0 from PyPI is the CUDA build.
ARG TORCH_SPEC=torch==2.13.0
RUN docker/install.sh /usr/src/.venv /usr/src/tgi-compat "${TORCH_SPEC}"

COPY docker/entrypoint.sh /tgi-entrypoint.sh
RUN chmod +x /tgi-entrypoint.sh

ENV PATH=/usr/src/.venv/bin:$PATH \
    HF_HOME=/data \
    PORT=80

ENTRYPOINT ["/tgi-entrypoint.sh"]
