#!/usr/bin/env bash
# The measurement of docs/performance-log.md in one device call: GPU suites, one-module compile times,
# the bfloat16 benchmark of the four bench shapes (decode + prefill, host cost), int2/int8 at 4096
# tokens. Peers run separately: SECTIONS=peers bash tools/device_check.sh (outputs under $OUT or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_env.sh
SECTIONS=tests TEST_TIMEOUT="${TEST_TIMEOUT:-200}" bash tools/device_check.sh 2>&1 | grep -vE "^\.|worst rel err" | tail -12
stamp "compile time, one module at a time (fresh cache)"
timeout 90 python3 -m qmoe_rtc warm --preset qwen3-30b-a3b --dtype bfloat16 --arch sm_90 --jobs 1 \
  --cache-dir /tmp/qmoe_fresh_cache --no-progress 2>&1 | tee "$OUT/warm.txt" | tail -5
stamp host
timeout 60 python3 tools/host_profile.py 2>&1 | tee "$OUT/host.txt" | head -4
stamp bench
timeout "${BENCH_TIMEOUT:-260}" python3 -m qmoe_rtc bench --dtype bfloat16 --tokens 1,8,64,512,4096 --iters 50 --no-torch \
  --check-rows 4 --host --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | grep -v "^  \["
stamp bits
timeout 90 python3 -m qmoe_rtc bench --preset qwen3-30b-a3b,mixtral-8x7b --dtype bfloat16 --tokens 4096 --bits 2 \
  --bits 8 --iters 30 --no-torch --no-eager --check-rows 4 --json "$OUT/bench-bits.json" 2>&1 | tee "$OUT/bench-bits.txt" \
  | grep -E "^(qwen|mix)"
stamp done
