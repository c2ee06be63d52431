#!/usr/bin/env bash
# One call on the GPU machine: environment, parallel precompile, the GPU test suites, compute-sanitizer
# over every engine, then the benchmark (decode, prefill, host cost) and, when the humming
# wheel and a copy of the peers script are carried (.whl/, .peers/), the peers side by side
# (python -m qmoe_rtc bench peers --script .peers/bench_peers.py).
#   SECTIONS="tests sanitize stress bench peers ab extra ext soak" bash tools/device_check.sh   (logs under $OUT or ./out)
#   bash tools/device_check.sh --help   (this text)
# suite: the whole GPU suite as SHARDS (default 3) pytest processes side by side (~3x faster than tests;
# the launch-overlap file first, alone).
# ab: both prefill engines forced; extra: fbgemm_w4 (.whl_fb/) and marlin (.marlin/*.so) peers;
# soak: python -m qmoe_rtc bench soak; ext: the shared experts + router GEMM targets (routed vs full layer),
# then FP8 vs int8 (EXT_SHAPES, EXT_TOKENS, FP8_SHAPES, FP8_TOKENS, ITERS).
# sanitize: tools/sanitize_case.py (every engine) under each of SANITIZERS (default memcheck racecheck synccheck).
# stress: python -m qmoe_rtc stress (STRESS_ARGS; default 16 processes, 1000 layer-runs per engine to pass).
# Failed tests, written as they fail: $OUT/failed_tests.txt.
# Knobs: TESTS (pytest paths), BENCH_ARGS, PEER_TOKENS, PEERS, SANITIZERS, SANITIZE_ARGS, STRESS_ARGS, *_TIMEOUT.
set -uo pipefail
case "${1:-}" in -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;; esac
cd "$(dirname "$0")/.."
SECTIONS="${SECTIONS:-tests sanitize bench}"
. tools/device_env.sh
# each failed test written down the moment it fails (tests/support/fail_log.py): a run cut at its limit still names them
export QMOE_RTC_FAIL_LOG="$OUT/failed_tests.txt"; : > "$QMOE_RTC_FAIL_LOG"

python3 -m qmoe_rtc info 2>&1 | tee "$OUT/info.txt" | grep -E "GPU 0|NVRTC|cupy|cuda-bindings|driver"
precompile "${PRECOMPILE_TIMEOUT:-120}"

if has tests; then
  stamp tests
  timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf -s ${TESTS:-tests/} 2>&1 \
    | tee "$OUT/gpu_tests.txt" | grep -E "worst|passed|failed|FAILED|Error|error" | tail -70
fi

if has suite; then  # the whole GPU suite in SHARDS parallel pytest processes (one GPU; the overlap file runs alone first)
  stamp suite
  files=$(ls tests/*/test_*_gpu.py | grep -v test_overlap_gpu.py)
  timeout "$(left "${TEST_TIMEOUT:-150}")" python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_overlap_gpu.py \
    2>&1 | tee "$OUT/gpu_tests_overlap.txt" | tail -2
  n="${SHARDS:-3}"; i=0; rm -f /tmp/shard_*
  for f in $files; do echo "$f" >> "/tmp/shard_$((i % n))"; i=$((i + 1)); done
  for s in $(seq 0 $((n - 1))); do
    [ -s "/tmp/shard_$s" ] || continue  # more shards than files
    timeout "$(left "${SUITE_TIMEOUT:-500}")" python3 -m pytest -q -m gpu -p no:cacheprovider -rf -s $(cat "/tmp/shard_$s") \
      > "$OUT/gpu_tests_shard$s.txt" 2>&1 &
  done
  wait
  for s in $(seq 0 $((n - 1))); do
    [ -s "/tmp/shard_$s" ] || continue
    echo "shard $s: $(tr '\n' ' ' < "/tmp/shard_$s")"; grep -E "FAILED|Error" "$OUT/gpu_tests_shard$s.txt" | head -20
    tail -1 "$OUT/gpu_tests_shard$s.txt"
  done
fi

if has sanitize; then  # every engine's forwards under each compute-sanitizer tool
  for tool in ${SANITIZERS:-memcheck racecheck synccheck}; do
    stamp "$tool"
    # shellcheck disable=SC2086
    timeout "$(left "${SANITIZE_TIMEOUT:-200}")" compute-sanitizer --tool "$tool" --report-api-errors no --print-limit 10 \
      python3 tools/sanitize_case.py ${SANITIZE_ARGS:-} 2>&1 | tee "$OUT/$tool.txt" | grep -E "SUMMARY|sanitize_case|FAILED|rror" | tail -6
  done
fi

if has stress; then  # contention: N processes at once, replay = eager bitwise = reference, every engine
  stamp stress
  # shellcheck disable=SC2086
  timeout "$(left "${STRESS_TIMEOUT:-400}")" python3 -m qmoe_rtc stress ${STRESS_ARGS:---procs 16 --seconds 240 --min-runs 1000} \
    --json "$OUT/stress.json" 2>&1 | tee "$OUT/stress.txt" | tail -30
fi

if has bench; then
  stamp bench
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT:-200}" python3 -m qmoe_rtc bench run ${BENCH_ARGS:---preset qwen3-30b-a3b,mixtral-8x7b --dtype bfloat16 --tokens 1,8,64,512,4096 --iters 50 --no-torch --check-rows 8 --host} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" | grep -v "^  \["
fi

if has peers && ls .whl/humming_kernels-*.whl >/dev/null 2>&1 && [ -f .peers/bench_peers.py ]; then
  stamp peers
  python3 -m pip install -q --no-deps --no-index --target /tmp/hsite .whl/humming_kernels-*.whl
  timeout "${PEERS_TIMEOUT:-300}" python3 -m qmoe_rtc bench peers --script .peers/bench_peers.py --humming-site /tmp/hsite \
    --peers "${PEERS:-humming,humming_g,gmm,qmoe_rtc}" --tokens "${PEER_TOKENS:-1,8,16,32,64,128,512,4096}" \
    --out "$OUT/peers.json" 2>&1 | tee "$OUT/peers.txt" | grep -vE "^# humming prep" | tail -60
fi
if has ab; then  # both prefill engines forced, same shapes: the crossover between them (and decode)
  for eng in mma wgmma; do
    stamp "ab $eng"
    QMOE_RTC_TUNE=prefill_engine=$eng timeout "${AB_TIMEOUT:-150}" python3 -m qmoe_rtc bench run --preset "${AB_PRESETS:-all}" \
      --dtype bfloat16 --tokens "${AB_TOKENS:-16,32,64,128,256}" --iters 50 --no-torch --no-eager --check-rows 8 \
      --decode-max-routes 0 --json "$OUT/ab_$eng.json" 2>&1 | tee "$OUT/ab_$eng.txt" | grep -E "^(qwen3|mixtral|gpt|ort)"
  done
fi

if has extra && ls .whl/humming_kernels-*.whl >/dev/null 2>&1 && [ -f .peers/bench_peers.py ]; then
  # FBGEMM's W4A16 grouped GEMM (.whl_fb/) or vLLM's Marlin MoE (.marlin/*.so), with humming_g as the yardstick
  python3 -m pip install -q --no-deps --no-index --target /tmp/hsite .whl/humming_kernels-*.whl
  if ls .whl_fb/*.whl >/dev/null 2>&1; then
    stamp "peers fbgemm_w4"
    python3 -m pip install -q --no-deps --no-index --target /tmp/fbsite .whl_fb/*.whl
    timeout "${EXTRA_TIMEOUT:-300}" python3 -m qmoe_rtc bench peers --script .peers/bench_peers.py --humming-site /tmp/hsite --fbgemm-site /tmp/fbsite \
      --peers humming_g,fbgemm_w4,qmoe_rtc --tokens "${PEER_TOKENS:-16,32,64,128,512,4096}" --out "$OUT/peers_fbgemm.json" 2>&1 \
      | tee "$OUT/peers_fbgemm.txt" | grep -vE "^# humming prep" | tail -40
  fi
  if ls .marlin/*.so >/dev/null 2>&1; then
    stamp "peers marlin"
    timeout "${EXTRA_TIMEOUT:-300}" python3 -m qmoe_rtc bench peers --script .peers/bench_peers.py --humming-site /tmp/hsite --marlin-so .marlin/*.so \
      --peers humming_g,marlin,qmoe_rtc --tokens "${PEER_TOKENS:-16,32,64,128,512,4096}" --out "$OUT/peers_marlin.json" 2>&1 \
      | tee "$OUT/peers_marlin.txt" | grep -vE "^# humming prep" | tail -40
  fi
fi

if has ext; then  # issue 12's targets: shared experts + router GEMM (routed vs full), FP8 vs int8
  stamp "shared experts + router GEMM"
  timeout "$(left "${EXT_TIMEOUT:-300}")" python3 -m qmoe_rtc bench run --shapes "${EXT_SHAPES:-qwen3-next-80b-a3b,deepseek-v3-tp8}" \
    --variants routed,full --dtype bfloat16 --tokens "${EXT_TOKENS:-1,8,64,512,4096}" --iters "${ITERS:-50}" --no-torch \
    --no-eager --check-rows 4 --json "$OUT/bench_ext.json" 2>&1 | tee "$OUT/bench_ext.txt" | grep -v "^  \["
  stamp "fp8 vs int8"
  timeout "$(left "${FP8_TIMEOUT:-240}")" python3 -m qmoe_rtc bench run --preset "${FP8_SHAPES:-qwen3-30b-a3b}" --dtype bfloat16 \
    --tokens "${FP8_TOKENS:-1,8,4096}" --bits 8 --format int,fp8_e4m3,fp8_e4m3:0 --iters "${ITERS:-50}" --no-torch --no-eager \
    --check-rows 4 --json "$OUT/bench_fp8.json" 2>&1 | tee "$OUT/bench_fp8.txt" | grep -v "^  \["
fi

if has soak; then
  stamp soak
  timeout "${SOAK_TIMEOUT:-240}" python3 -m qmoe_rtc bench soak 2>&1 | tee "$OUT/soak.txt" | tail -25
fi

stamp done
