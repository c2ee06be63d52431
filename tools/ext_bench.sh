#!/usr/bin/env bash
# One device call for issue 12's targets: shared experts + router GEMM (routed vs full layer) on the
# qwen3-next-80b-a3b and deepseek-v3-tp8 presets, and FP8 vs int8 (decode %floor, prefill time).
#   bash tools/ext_bench.sh        (logs and JSON under $OUT or ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_env.sh
stamp "shared experts + router GEMM"
timeout "${EXT_TIMEOUT:-300}" python3 -m qmoe_rtc bench --shapes "${EXT_SHAPES:-qwen3-next-80b-a3b,deepseek-v3-tp8}" \
  --variants routed,full --dtype bfloat16 --tokens "${EXT_TOKENS:-1,8,64,512,4096}" --iters "${ITERS:-50}" --no-torch \
  --no-eager --check-rows 4 --json "$OUT/bench_ext.json" 2>&1 | tee "$OUT/bench_ext.txt" | grep -v "^  \["
stamp "fp8 vs int8"
timeout "${FP8_TIMEOUT:-240}" python3 -m qmoe_rtc bench --preset "${FP8_SHAPES:-qwen3-30b-a3b}" --dtype bfloat16 \
  --tokens "${FP8_TOKENS:-1,8,4096}" --bits 8 --bits fp8 --bits fp8g --iters "${ITERS:-50}" --no-torch --no-eager \
  --check-rows 4 --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.txt" | grep -v "^  \["
stamp done
