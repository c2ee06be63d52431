#!/usr/bin/env bash
# One call on the GPU machine: the prefill GPU tests on both engines, then the benchmark with each
# prefill engine forced (QMOE_RTC_PREFILL_ENGINE=mma / wgmma), same shapes, same process per engine.
#   TESTS_K="wgmma" PRESETS=qwen3-30b-a3b,mixtral-8x7b TOKENS=64,512,4096 bash tools/prefill_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_env.sh
precompile "${PRECOMPILE_TIMEOUT:-150}"
if [ "${TESTS_K:-}" != "none" ]; then
  stamp tests
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf -s -x ${TESTS:-tests/test_mma_prefill_gpu.py} \
    ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/prefill_tests.txt" | grep -E "worst|passed|failed|FAILED|Error|error" | tail -50
fi
for eng in ${ENGINES:-mma wgmma}; do
  stamp "bench $eng"
  QMOE_RTC_PREFILL_ENGINE=$eng timeout "${BENCH_TIMEOUT:-200}" python3 -m qmoe_rtc bench \
    --preset "${PRESETS:-qwen3-30b-a3b,mixtral-8x7b}" --dtype "${DTYPES:-bfloat16}" --tokens "${TOKENS:-64,512,4096}" \
    --iters 50 --no-torch --no-eager --check-rows 8 --json "$OUT/bench_$eng.json" 2>&1 | tee "$OUT/bench_$eng.txt" \
    | grep -v "^  \["
done
stamp done
