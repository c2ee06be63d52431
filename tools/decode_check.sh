#!/usr/bin/env bash
# Decode round 2 on the GPU machine (issue 13), in sections so one device call fits each:
#   tests  the GPU tests of what the decode work touches (TESTS to change them)
#   ab     the decode bench once per setting of AB (space-separated "NAME=V,NAME=V" knob sets; default
#          QMOE_RTC_PDL=0 then =1: programmatic dependent launch off / on), same shapes, same machine
#   bits   int2 / int3 / int4 at 1 token (mixtral, gpt-oss): the narrow-code target (BITS_ARGS: more bench
#          options, e.g. --zero-points)
#   knobab tools/knob_ab.py: the settings of KNOB_AB (default expert flow off / on) timed in turns in one
#          process (KNOB_AB_SHAPES, KNOB_AB_TOKENS): for differences below the ~3 % between bench processes
#   peers  humming, humming_g and vLLM's Marlin MoE beside qmoe_rtc in one process (.whl/, .peers/, .marlin/)
#   probe  tools/stream_probe.py: the weight stream's own rate, no arithmetic (row-major vs tiled, ring depth)
#   ncu    warp stall reasons, memory and occupancy of FC1 / FC2 at 1 token (NCU_SHAPES: "shape" or "shape:bits"
#          items, default mixtral, qwen3 at 4 bits)
#   SECTIONS="tests ab" bash tools/decode_check.sh      (logs under $OUT or ./out)
set -uo pipefail
cd "$(dirname "$0")/.."
SECTIONS="${SECTIONS:-tests ab}"
. tools/device_env.sh
SHAPES="${SHAPES:-qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048}"

python3 -m qmoe_rtc info 2>&1 | grep -E "GPU 0|driver" | head -3
precompile "${PRECOMPILE_TIMEOUT:-80}"

if has tests; then
  stamp tests
  timeout "$(left "${TEST_TIMEOUT:-240}")" python3 -m pytest -q -m gpu -p no:cacheprovider -rf -x \
    ${TESTS:-tests/test_overlap_gpu.py tests/test_mma_decode_gpu.py tests/test_graphs_gpu.py tests/test_route_ext_gpu.py} \
    2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "passed|failed|FAILED|Error" | tail -30
  if [ "${PIPESTATUS[0]}" != 0 ] && [ "${STOP_ON_FAIL:-1}" = 1 ]; then stamp "tests did not pass: stopping"; exit 1; fi
fi

if has ab; then  # one bench per AB setting ("NAME=V,NAME=V" items; default: programmatic dependent launch off / on)
  for setting in ${AB:-QMOE_RTC_PDL=0 QMOE_RTC_PDL=1}; do
    stamp "bench $setting"
    tag=$(echo "$setting" | tr -c 'A-Za-z0-9\n' '_')
    env ${setting//,/ } timeout "$(left "${BENCH_TIMEOUT:-150}")" python3 -m qmoe_rtc bench --preset "$SHAPES" \
      --dtype "${DTYPES:-bfloat16}" --tokens "${AB_TOKENS:-1,2,4,8}" --iters 50 --no-torch --no-eager --check-rows "${CHECK_ROWS:-8}" \
      --json "$OUT/bench_$tag.json" 2>&1 | tee "$OUT/bench_$tag.txt" | grep -E "^(qwen3|mixtral|gpt|ort)|target|error" | head -60
  done
fi

if has bits; then
  stamp bits
  timeout "$(left "${BITS_TIMEOUT:-150}")" python3 -m qmoe_rtc bench --preset mixtral-8x7b,gpt-oss-120b --dtype bfloat16 --tokens 1 \
    --bits 2 --bits 3 --bits 4 --iters 50 --no-torch --no-eager --check-rows 8 ${BITS_ARGS:-} --json "$OUT/bench_bits.json" 2>&1 \
    | tee "$OUT/bench_bits.txt" | grep -E "^(mixtral|gpt)|target|error" | head -20
fi

if has peers && ls .whl/humming_kernels-*.whl >/dev/null 2>&1 && [ -f .peers/bench_peers.py ]; then
  stamp peers
  python3 -m pip install -q --no-deps --no-index --target /tmp/hsite .whl/humming_kernels-*.whl
  marlin=(); peers="humming,humming_g,qmoe_rtc"
  if ls .marlin/*.so >/dev/null 2>&1; then marlin=(--marlin-so .marlin/*.so); peers="humming,humming_g,marlin,qmoe_rtc"; fi
  timeout "$(left "${PEERS_TIMEOUT:-300}")" python3 .peers/bench_peers.py --humming-site /tmp/hsite --qmoe-path . "${marlin[@]}" \
    --peers "${PEERS:-$peers}" --tokens "${PEER_TOKENS:-1,2,4,8,16,32,64}" --out "$OUT/peers.json" 2>&1 \
    | tee "$OUT/peers.txt" | grep -vE "^# (humming|marlin) prep|Deprecation|return g.replay" | tail -45
fi
if has knobab; then
  stamp knobab
  timeout "$(left "${KNOB_AB_TIMEOUT:-150}")" python3 tools/knob_ab.py ${KNOB_AB:-mma_expert_flow=0 mma_expert_flow=1} \
    --preset "${KNOB_AB_SHAPES:-mixtral-8x7b,gpt-oss-120b}" --tokens "${KNOB_AB_TOKENS:-1,8}" --json "$OUT/knob_ab.json" 2>&1 \
    | tee "$OUT/knob_ab.txt" | tail -40
fi
if has probe; then
  stamp probe
  timeout "$(left "${PROBE_TIMEOUT:-120}")" python3 tools/stream_probe.py 2>&1 | tee "$OUT/probe.txt"
fi

if has ncu; then
  for item in ${NCU_SHAPES:-mixtral-8x7b qwen3-30b-a3b}; do  # "shape" or "shape:bits" (default 4)
    shape=${item%%:*}; nbits=${item#*:}; [ "$nbits" = "$item" ] && nbits=4
    stamp "ncu $shape int$nbits"
    timeout "$(left "${NCU_TIMEOUT:-120}")" ncu --clock-control none --kernel-name regex:"fc1_mma|fc2_mma" \
      --launch-skip 2 --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 tools/profile_decode.py --preset "$shape" --bits "$nbits" --tokens "${NCU_TOKENS:-1}" --calls 3 2>&1 \
      | tee "$OUT/ncu_${shape}_int$nbits.txt" | grep -vE "^==PROF==|^ *-+ *$|^    [A-Z].*:$" \
      | grep -E "fc1_mma|fc2_mma|Duration|DRAM Through|Memory Through|Stall|Warp Cycles|Issued Warp|No Eligible|Active Warps|Achieved Occ|Registers|Theoretical Occ|Block Limit|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Eligible|stalled" | grep -vE "stalled_[a-z_]+_per_issue_active.ratio +ratio +0\.0[0-9]?$" | head -80
  done
fi
stamp done
