#!/bin/bash
# The GPU work still waiting (docs/benchmarks/2026-12-05-session-24.md, "Not run this session"), in parts that each fit one device call
# (under 10 minutes on an H100 or H200, compiles included). From the repo root, carrying .whl:
#   bash benchmarks/device/queue.sh tests-a        # tests/gpu without the VLM and LoRA files (~8 min)
#   bash benchmarks/device/queue.sh tests-b        # the VLM and LoRA GPU tests (~6 min)
#   bash benchmarks/device/queue.sh plain vl       # several parts in one call, in order, each under its own limit
# Parts: tests-a tests-b attn plain itl mixed lora lora-fp8 lora-step lora-step-folded lora-step-segmented vl vl-profile vl-threads vision diverse diverse32 diverse64 diverse64-forms diverse64-profile diverse-kernel-ab spec eagle3 (itl: the
# plain rows, then at --max-mixed-prefill-tokens 256 and 512, ~85 s each on an H100; eagle3 after spec in the same
# call: it reuses spec's plain rows; diverse64: 512 rows, where attention is the larger share of a step).
# Logs and JSON under $OUT; a part past its limit is cut and the next one runs.
set -u
source "$(dirname "$0")/setup.sh"
part() {  # name seconds command...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc $?" >> "$OUT/$name.log"
  tail -25 "$OUT/$name.log"
}
segmented_step() {  # seconds: the LoRA decode step through the segmented kernels alone (int8/int4's path)
  part lora-step-segmented "$1" python3 -m benchmarks.device.lora_step --segmented --skip-sweep \
    --json "$OUT/lora_step_segmented.json"
}
gpu_tests=(python3 -m pytest -q -rfE -m gpu -p no:cacheprovider --durations=10)
for name in "$@"; do
  case $name in
    tests-a) part tests-a 540 "${gpu_tests[@]}" tests/gpu --ignore=tests/gpu/test_llava_next_gpu.py \
               --ignore=tests/gpu/test_qwen2_5_vl_gpu.py --ignore=tests/gpu/test_lora_gpu.py ;;
    attn) part attn 200 "${gpu_tests[@]}" tests/gpu/test_attention_gpu.py ;;  # (in tests-a too; ~1-2 min alone)
    tests-b) part tests-b 480 "${gpu_tests[@]}" tests/gpu/test_lora_gpu.py tests/gpu/test_qwen2_5_vl_gpu.py \
               tests/gpu/test_llava_next_gpu.py ;;
    plain) part plain 240 env OURS_ONLY=1 bash benchmarks/device/side_by_side.sh ;;
    itl) part plain 150 env OURS_ONLY=1 bash benchmarks/device/side_by_side.sh  # (the baseline on the same machine)
         for n in 256 512; do
           part itl-$n 150 env OURS_ONLY=1 OURS_ARGS="--max-mixed-prefill-tokens $n" bash benchmarks/device/side_by_side.sh
         done ;;
    lora) part lora 330 python3 -m benchmarks.device.lora ;;
    lora-step) part lora-step 200 python3 -m benchmarks.device.lora_step
               segmented_step 150 ;;
    lora-step-folded) part lora-step 120 python3 -m benchmarks.device.lora_step --skip-sweep ;;
    lora-step-segmented) segmented_step 120 ;;
    vl) part vl 270 python3 -m benchmarks.device.qwen_vl ;;
    vl-profile)  # the images phase's forward steps 4-7 (after the warm-up's 2) under the profiler: the .txt comes back
      part vl-profile 270 env TGI_PROFILE_DIR="$OUT/vlprof" TGI_PROFILE_STEPS=4:4 \
        python3 -m benchmarks.device.qwen_vl --skip-plain
      find "$OUT/vlprof" -name '*.json.gz' -delete ;;
    vl-threads)  # the images phase with 3 image processor threads (the default), then 8 (the first step's wait)
      for threads in 3 8; do
        part vl-threads$threads 150 python3 -m benchmarks.device.qwen_vl --skip-plain --processor-threads $threads
      done ;;
    vision) part vision 200 python3 -m benchmarks.device.vision_encoder ;;
    diverse) part diverse 270 python3 -m benchmarks.device.diverse --skip-check --groups 8,16,32 --engine-groups 16 ;;
    diverse32) part diverse32 240 python3 -m benchmarks.device.diverse --skip-check --groups 32 --engine-groups 32 ;;
    diverse64) part diverse64 300 python3 -m benchmarks.device.diverse --skip-check --groups 64 --engine-groups 64 ;;
    diverse64-forms)  # the engine with diverse mode off, then on with each form of the shared-prefix kernel
      part diverse64-forms 300 python3 -m benchmarks.device.diverse --skip-check --groups 64 --engine-groups 64 \
        --skip-sweep --both-forms ;;
    diverse-kernel-ab)  # the shared-prefix kernel alone at 32 and 64 groups, in an older tree (.branches/old, carried:
      # `git archive REV tgi_compat benchmarks | tar -x -C .branches/old`) and then in this one, on the same machine
      if [ -d .branches/old ]; then
        (cd .branches/old && part diverse-kernel-old 120 env PYTHONPATH="$PWD:/tmp/site" python3 -m benchmarks.device.diverse \
          --skip-check --skip-engine --groups 32,64 --engine-groups 0)
      fi
      part diverse-kernel-new 180 python3 -m benchmarks.device.diverse --skip-check --skip-engine --groups 32,64 \
        --engine-groups 64 ;;  # (this tree's with the split / stage / tiling sweep at 64 groups)
    lora-fp8) part lora-step-fp8 150 python3 -m benchmarks.device.lora_step --quantize fp8 --skip-sweep --rows 1,64 \
                --json "$OUT/lora_step_fp8.json"
              part lora-fp8 200 python3 -m benchmarks.device.lora --fp8-only ;;
    diverse64-profile)  # each mode's decode steps 120-125 under the profiler: the .txt summaries only come back
      part diverse64-profile 300 env TGI_PROFILE_DIR="$OUT/prof" TGI_PROFILE_STEPS=120:6 \
        python3 -m benchmarks.device.diverse --skip-check --groups 64 --engine-groups 64
      find "$OUT/prof" -name '*.json.gz' -delete ;;
    mixed) part mixed 200 python3 -m benchmarks.device.mixed_step ;;
    spec) part spec 420 python3 -m benchmarks.device.speculative ;;
    eagle3) part eagle3 240 python3 -m benchmarks.device.speculative --method eagle3 --plain-from "$OUT/speculative.json" ;;
    *) echo "unknown part: $name"; exit 2 ;;
  esac
  # a part's servers and engines: python processes only (session 25: a pattern on any command line also matched the
  # device call's own shell when its command named a benchmark after queue.sh, and ended the call)
  pkill -f "^[^ ]*python[0-9.]* .*(tgi_compat\\.|benchmarks\\.device\\.)" 2>/dev/null; sleep 2
done
