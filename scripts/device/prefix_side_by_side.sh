#!/bin/bash
# Prefix-cache workloads (benchmarks/multiturn.py) on one random Llama-3-8B, one device call: LightLLM
# v1.2.0 with its prompt cache on (prepared per lightllm_peer.md, in .peer/), then this project with the
# cache on, then off. Each server gets the same client and workloads:
#   shared     128 requests of one 4,000-token system prompt + a distinct 64-token question, CONCURRENCY
#              (16) in flight, 64 tokens out
#   multiturn  NUM_CONVERSATIONS (128) ShareGPT conversations replayed turn by turn with the server's own
#              answers as history (a chat client), MULTITURN_CONCURRENCY (64) conversations in flight,
#              answers capped at 128 tokens, prompt + answer <= 4,096 tokens
# Run from the repo root on the device, carrying [".whl", ".peer"]:
#   bash scripts/device/prefix_side_by_side.sh        (SKIP_LIGHTLLM=1: this project alone)
# Results: $OUT/<server>-<workload>/result.json and one line each in $OUT/summary.txt.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists"
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
[ -f /tmp/model/config.json ] || python3 -m benchmarks.random_model /tmp/model --preset llama3-8b --device cuda || exit 1
CONCURRENCY=${CONCURRENCY:-16} MULTITURN_CONCURRENCY=${MULTITURN_CONCURRENCY:-64} NUM_CONVERSATIONS=${NUM_CONVERSATIONS:-128}

workloads() {  # label url [client args...]
  local label=$1 url=$2; shift 2
  timeout 200 python3 -m benchmarks.multiturn --base-url "$url" --tokenizer /tmp/model "$@" --label "$label-shared" \
    --out-dir "$OUT/$label-shared" --workload shared-prefix --num-prompts 128 --system-len 4000 \
    --concurrency "$CONCURRENCY" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
  timeout 240 python3 -m benchmarks.multiturn --base-url "$url" --tokenizer /tmp/model "$@" --label "$label-multiturn" \
    --out-dir "$OUT/$label-multiturn" --workload multiturn --num-conversations "$NUM_CONVERSATIONS" \
    --max-output-len 128 --history model --concurrency "$MULTITURN_CONCURRENCY" 2>&1 | tail -n 1 | tee -a "$OUT/summary.txt"
}
wait_up() {  # pid url log
  for _ in $(seq 1 400); do
    curl -sf "$2/health" > /dev/null && return 0
    kill -0 "$1" 2> /dev/null || { tail -30 "$3"; return 1; }
    sleep 1
  done
  return 1
}
stop() { kill -TERM -- "-$1" 2> /dev/null; for _ in $(seq 20); do kill -0 "$1" 2> /dev/null || break; sleep 1; done; kill -KILL -- "-$1" 2> /dev/null; sleep 3; }

if [ -z "${SKIP_LIGHTLLM:-}" ]; then
  setsid env PYTHONPATH=$PWD/.peer/lightllm-src:/tmp/site python3 -m lightllm.server.api_server --model_dir /tmp/model \
    --host 127.0.0.1 --port 8000 --tp 1 --data_type bfloat16 --max_req_total_len 8192 --mem_fraction 0.85 \
    --running_max_req_size 256 --llm_prefill_att_backend triton --llm_decode_att_backend triton \
    --sampling_backend triton > "$OUT/lightllm.log" 2>&1 &
  pid=$!
  wait_up $pid http://127.0.0.1:8000 "$OUT/lightllm.log" && workloads lightllm http://127.0.0.1:8000 --no-details
  stop $pid
fi
for cache in 1 0; do
  setsid env PREFIX_CACHING=$cache python3 -m tgi_compat.cli.launcher --model-id /tmp/model --hostname 127.0.0.1 \
    --port 8001 --max-concurrent-requests 2048 > "$OUT/ours-cache$cache.log" 2>&1 &
  pid=$!
  wait_up $pid http://127.0.0.1:8001 "$OUT/ours-cache$cache.log" && workloads "ours-cache$cache" http://127.0.0.1:8001
  stop $pid
done
