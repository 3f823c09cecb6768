#!/usr/bin/env bash
# GPU serving benchmark (not CI): a random-weight Llama-3-8B-shaped model, our server, the load
# benchmark at several request rates, offline throughput, and the transformers static-batching baseline.
#
# Needs: torch, triton, transformers, safetensors, tokenizers, numpy, aiohttp, tqdm (GPU image), plus the
# wheels from the wheelhouse with these extras (quicktok-v1 carries the Llama-3 vocabulary; matplotlib
# and its dependencies draw the plots, which are skipped if it is missing):
#   ../shared/device/wheelhouse.sh quicktok-v1 httptools uvloop matplotlib contourpy cycler fonttools kiwisolver pillow \
#       pyparsing python-dateutil six packaging
# Run (repo root on the device, carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=$PWD:/tmp/site && bash benchmarks/device/serve_bench.sh
# Everything fits one 10-minute call only if the server is fast; split it with STAGES, e.g.
#   STAGES=model,online,offline bash benchmarks/device/serve_bench.sh   then   STAGES=compare bash ...
# (the model folder in /tmp is reused while the machine stays warm, rebuilt otherwise: ~1-2 min).
# Results: $OUT/{online,offline,compare}/{result.json,index.html,*.png}, $OUT/*.log, $OUT/summary.txt.
set -euo pipefail

OUT=${OUT:-$PWD/serve-bench-out}
MODEL_DIR=${MODEL_DIR:-/tmp/llama3-8b-random}
PORT=${PORT:-3000}
STAGES=${STAGES:-model,fixed,online,offline,compare}
RATES=${RATES:-2,8,32}            # online request rates (Poisson); inf is the offline stage
NUM_ONLINE=${NUM_ONLINE:-200}     # prompts per online rate
NUM_OFFLINE=${NUM_OFFLINE:-1000}  # prompts for the all-at-once server run
NUM_COMPARE=${NUM_COMPARE:-256}   # prompts for server vs transformers (same prompts for both)
HF_BATCH=${HF_BATCH:-64}
FIXED_CONCURRENCY=${FIXED_CONCURRENCY:-64}  # the project bar: 64 streams of 256 in / 256 out
# All-at-once stages send more than TGI's default 128 permits; the rest would get 429.
SERVER_ARGS=${SERVER_ARGS:---max-concurrent-requests 2048}  # extra launcher flags
STAGE_TIMEOUT=${STAGE_TIMEOUT:-560}
PY=${PYTHON:-python3}
# Llama-3 ShareGPT lengths from benchmarks/data; EXTRA_ARGS e.g. "--max-output-len 8" for a dry run.
read -r -a DATASET <<< "--dataset sharegpt-lengths --seed 0 ${EXTRA_ARGS:-}"

mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/server.sh"
SERVER_CMD="$PY -m tgi_compat.api.cli.launcher --model-id $MODEL_DIR --port $PORT --hostname 127.0.0.1 $SERVER_ARGS"
has_stage() { [[ ",$STAGES," == *",$1,"* ]]; }

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; } > "$OUT/device.txt"
$PY -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)" >> "$OUT/device.txt"
git rev-parse HEAD >> "$OUT/device.txt" 2>/dev/null || true

run_stage() {  # name, command...: a failed or timed-out stage is logged, later stages still run
  local name=$1; shift
  log "stage $name: $*"
  if timeout "$STAGE_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1; then
    grep -E '^(---|    [A-Z]|server_|hf_|results)' "$OUT/$name.log" | tee -a "$OUT/summary.txt" || true
  else
    log "stage $name failed (exit $?); tail of $OUT/$name.log:"; tail -n 30 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  fi
}

build_model  # every stage needs it (reused when already built)

if has_stage fixed || has_stage online || has_stage offline; then
  start_server main $SERVER_CMD
  has_stage fixed && run_stage fixed $PY -m benchmarks.serve --base-url "$BASE_URL" --dataset fixed \
    --input-len 256 --output-len 256 --num-prompts $((FIXED_CONCURRENCY * 4)) --request-rate inf \
    --max-concurrency "$FIXED_CONCURRENCY" --tokenizer "$MODEL_DIR" --out-dir "$OUT/fixed" --no-progress
  has_stage online && run_stage online $PY -m benchmarks.serve --base-url "$BASE_URL" "${DATASET[@]}" \
    --num-prompts "$NUM_ONLINE" --request-rate "$RATES" --out-dir "$OUT/online" --no-progress
  has_stage offline && run_stage offline $PY -m benchmarks.offline --base-url "$BASE_URL" "${DATASET[@]}" \
    --num-prompts "$NUM_OFFLINE" --out-dir "$OUT/offline" --no-progress
  stop_server
fi

# Server and transformers on the same prompts, one after the other, each with the whole GPU.
has_stage compare && run_stage compare $PY -m benchmarks.offline --server-cmd "$SERVER_CMD" \
  --base-url "$BASE_URL" "${DATASET[@]}" --num-prompts "$NUM_COMPARE" --hf-model "$MODEL_DIR" \
  --hf-batch-size "$HF_BATCH" --hf-dtype bfloat16 --out-dir "$OUT/compare" --no-progress
log "done; results under $OUT"
