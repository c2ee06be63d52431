#!/usr/bin/env bash
# One call on the GPU machine: environment, GPU test suite, benchmark, peers side by side.
#   bash tools/gpu_check.sh                      # everything
#   SKIP_TESTS=1 SKIP_PEERS=1 bash tools/gpu_check.sh --tokens 1,8   # bench only, extra bench args
# Peers need the humming wheel in .whl/ and a copy of ../shared/peers/bench_peers.py in .peers/
# (both git-ignored; carry them with the device tool). Logs go to $OUT (or ./out).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export QMOE_RTC_CACHE_DIR="${QMOE_RTC_CACHE_DIR:-/tmp/qmoe_rtc_cache}"
rc=0
python3 -m qmoe_rtc info 2>&1 | tee "$OUT/info.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/info.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "== GPU tests"
  python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/ 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "worst|passed|failed|Error" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench"
  timeout "${BENCH_TIMEOUT:-240}" python3 -m qmoe_rtc bench --check-rows 16 "$@" --json "$OUT/bench.json" 2>&1 \
    | tee "$OUT/bench.txt" | grep -v "^  \[" || rc=1
fi
if [ "${SKIP_PEERS:-0}" != 1 ] && ls .whl/humming_kernels-*.whl >/dev/null 2>&1 && [ -f .peers/bench_peers.py ]; then
  echo "== peers (bf16, int4, CUDA-graph replay, L2 flushed)"
  python3 -m pip install -q --no-deps --no-index --target /tmp/hsite .whl/humming_kernels-*.whl
  timeout "${PEERS_TIMEOUT:-300}" python3 .peers/bench_peers.py --humming-site /tmp/hsite --qmoe-path . \
    --peers "${PEERS:-humming,humming_g,gmm,qmoe_rtc}" --tokens "${PEER_TOKENS:-1,2,4,8,64}" \
    --out "$OUT/peers.json" 2>&1 | tee "$OUT/peers.txt" | grep -vE "^# humming prep" | tail -40 || rc=1
fi
exit $rc
