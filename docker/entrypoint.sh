#!/usr/bin/env bash
# The image's entrypoint, as TGI's /tgi-entrypoint.sh: launcher flags pass straight through, so
#   docker run --gpus all -p 8080:80 -v $PWD/data:/data <image> --model-id <id>
# works as with TGI. Docker sets HOSTNAME to the container id; the launcher reads it for
# --hostname, finds it is not an IP, warns and binds 0.0.0.0 (TGI's fallback).
set -e
ldconfig 2>/dev/null || true  # make the CUDA driver libraries mounted by the runtime visible
source /usr/src/.venv/bin/activate
exec text-generation-launcher "$@"
