#!/usr/bin/env bash
# One call on the GPU machine: environment, GPU test suite, demo, benchmark.
# Usage (repo root, on the GPU host):  bash tools/gpu_check.sh [pytest -k expression] [bench args...]
# Writes logs under $OUT (or ./out) so they come back from the device tool.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export QMOE_RTC_CACHE_DIR="${QMOE_RTC_CACHE_DIR:-/tmp/qmoe_rtc_cache}"
K="${1:-}"; shift || true
rc=0
python3 -m qmoe_rtc info 2>&1 | tee "$OUT/info.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/info.txt"
echo "== GPU tests"
python3 -m pytest -q -m gpu -p no:cacheprovider ${K:+-k "$K"} -s tests/ 2>&1 | tee "$OUT/gpu_tests.txt" | grep -Ev "^(tests/|\.+$)" | tail -60
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== demo"
python3 -m qmoe_rtc demo --tokens 4 2>&1 | tee "$OUT/demo.txt" || rc=1
if [ -f qmoe_rtc/bench.py ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== bench"
  python3 -m qmoe_rtc bench "$@" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" || rc=1
fi
exit $rc
