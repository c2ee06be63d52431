#!/usr/bin/env bash
# The issue-5 measurement in one device call: GPU correctness (mma + executor suites), the f16 bench
# with the torch baseline, a bit-width sweep, then the bf16 peers comparison (humming) in one process.
#   bash tools/final_check.sh      (outputs under $OUT or ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export QMOE_RTC_CACHE_DIR="${QMOE_RTC_CACHE_DIR:-/tmp/qmoe_rtc_cache}"
echo "== GPU tests (mma decode + executor)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf -s tests/test_mma_decode_gpu.py tests/test_executor_gpu.py \
  2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "worst|passed|failed|FAILED" | tail -60
echo "== bench float16"
timeout 150 python3 -m qmoe_rtc bench --tokens 1,2,4,8,64 --iters 50 --no-eager --check-rows 16 --json "$OUT/bench-f16.json" \
  2>&1 | tee "$OUT/bench-f16.txt" | grep -v "^  \["
echo "== bits sweep"
timeout 60 python3 -m qmoe_rtc bench --preset mixtral-8x7b,ort-2048,qwen3-30b-a3b --tokens 1,8 --bits 2 --bits 3 --bits 8 \
  --iters 50 --no-torch --no-eager --check-rows 4 --json "$OUT/bench-bits.json" 2>&1 | tee "$OUT/bench-bits.txt" | grep -E "^(qwen|mix|ort)"
SKIP_TESTS=1 SKIP_BENCH=1 PEERS_TIMEOUT="${PEERS_TIMEOUT:-200}" PEER_TOKENS="${PEER_TOKENS:-1,2,4,8,64}" bash tools/gpu_check.sh >/dev/null 2>&1
echo "== peers"; grep -vE "^# humming prep" "$OUT/peers.txt" | tail -45
