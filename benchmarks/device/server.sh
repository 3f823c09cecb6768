# Sourced by the device benchmarks (serve_bench.sh, prefix_cache_bench.sh): a summary log, the
# random-weight model, and our server's start / health wait / stop. The caller sets OUT, MODEL_DIR,
# PORT and PY first; HEALTH_TIMEOUT (seconds) bounds the wait for /health.

BASE_URL="http://127.0.0.1:$PORT"
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-900}

log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/summary.txt"; }

build_model() {  # random Llama-3-8B-shaped bf16 weights, reused while the machine stays warm
  if [[ -f "$MODEL_DIR/.complete" ]]; then log "model: reusing $MODEL_DIR"; return; fi
  log "model: building random Llama-3-8B-shaped bf16 weights on cuda into $MODEL_DIR"
  rm -rf "$MODEL_DIR"
  $PY -m benchmarks.random_model "$MODEL_DIR" --preset llama3-8b --device cuda --dtype bfloat16 \
    2>&1 | tail -n 3 | tee -a "$OUT/summary.txt"
  touch "$MODEL_DIR/.complete"
}

SERVER_PID=
start_server() {  # name, then the server command; its output goes to $OUT/server-<name>.log
  local name=$1; shift
  log "server $name: $*"
  setsid "$@" > "$OUT/server-$name.log" 2>&1 &
  SERVER_PID=$!
  local waited=0
  until $PY -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" \
        "$BASE_URL/health" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then log "server exited; tail of log:"; tail -n 40 "$OUT/server-$name.log"; return 1; fi
    sleep 2; waited=$((waited + 2))
    if (( waited > HEALTH_TIMEOUT )); then log "server not healthy after $HEALTH_TIMEOUT s"; return 1; fi
  done
  log "server $name: healthy after ${waited} s"
}

stop_server() {  # the server's whole process group: TERM, then KILL after 30 s
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || kill -TERM "$SERVER_PID"
    for _ in $(seq 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=
}
trap stop_server EXIT
