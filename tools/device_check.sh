#!/usr/bin/env bash
# One call on the GPU machine: environment, parallel precompile, the GPU test suites, a memcheck of one
# prefill and one decode call, then the benchmark (decode, prefill, host cost) and, when the humming
# wheel and a copy of the peers script are carried (.whl/, .peers/), the peers side by side.
#   SECTIONS="tests memcheck bench peers" bash tools/device_check.sh      (logs under $OUT or ./out)
# Knobs: TESTS (pytest paths), BENCH_ARGS, PEER_TOKENS, PEERS, *_TIMEOUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
export QMOE_RTC_CACHE_DIR="${QMOE_RTC_CACHE_DIR:-/tmp/qmoe_rtc_cache}"
SECTIONS="${SECTIONS:-tests memcheck bench}"
has() { case " $SECTIONS " in *" $1 "*) return 0;; esac; return 1; }
t0=$(date +%s)
stamp() { echo "== $1 (+$(( $(date +%s) - t0 )) s)"; }

python3 -m qmoe_rtc info 2>&1 | tee "$OUT/info.txt" | grep -E "GPU 0|NVRTC|cupy|cuda-bindings|driver"
stamp precompile
timeout "${PRECOMPILE_TIMEOUT:-120}" python3 tools/precompile.py --arch sm_90 --jobs 16 2>&1 | tail -3

if has tests; then
  stamp tests
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf -s ${TESTS:-tests/} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | grep -E "worst|passed|failed|FAILED|Error|error" | tail -70
fi

if has memcheck; then
  stamp memcheck
  timeout "${MEMCHECK_TIMEOUT:-150}" compute-sanitizer --tool memcheck --report-api-errors no --print-limit 10 python3 tools/sanitize_case.py \
    2>&1 | tee "$OUT/memcheck.txt" | tail -8
fi

if has bench; then
  stamp bench
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-200}" python3 -m qmoe_rtc bench ${BENCH_ARGS:---preset qwen3-30b-a3b,mixtral-8x7b --dtype bfloat16 --tokens 1,8,64,512,4096 --iters 50 --no-torch --check-rows 8 --host} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | grep -v "^  \["
fi

if has peers && ls .whl/humming_kernels-*.whl >/dev/null 2>&1 && [ -f .peers/bench_peers.py ]; then
  stamp peers
  python3 -m pip install -q --no-deps --no-index --target /tmp/hsite .whl/humming_kernels-*.whl
  timeout "${PEERS_TIMEOUT:-300}" python3 .peers/bench_peers.py --humming-site /tmp/hsite --qmoe-path . \
    --peers "${PEERS:-humming,humming_g,gmm,qmoe_rtc}" --tokens "${PEER_TOKENS:-1,8,64,512,4096}" \
    --out "$OUT/peers.json" 2>&1 | tee "$OUT/peers.txt" | grep -vE "^# humming prep" | tail -60
fi
stamp done
