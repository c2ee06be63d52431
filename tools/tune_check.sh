#!/usr/bin/env bash
# A tuning call on the GPU machine: the host-cost profile, prefill knob sweeps, and ncu on one prefill kernel.
#   bash tools/tune_check.sh      (logs under $OUT or ./out); SWEEPS / NCU_ARGS override the defaults
set -uo pipefail
cd "$(dirname "$0")/.."
. tools/device_env.sh
stamp host
timeout 60 python3 tools/host_profile.py 2>&1 | tee "$OUT/host.txt"
stamp sweep
while IFS= read -r sweep; do
  [ -n "$sweep" ] || continue
  # shellcheck disable=SC2086
  timeout 150 python3 tools/prefill_sweep.py $sweep 2>&1 | tee -a "$OUT/sweep.txt"
done <<< "${SWEEPS:---preset mixtral-8x7b --tokens 4096 --grid prefill_warps=4,8 --grid prefill_stages=2,3,4
--preset qwen3-30b-a3b --tokens 512,4096 --grid prefill_warps=4,8 --grid prefill_route_tile=32,64}"
if [ -n "${NCU_ARGS-x}" ]; then
  stamp ncu
  # shellcheck disable=SC2086
  timeout 150 ncu --clock-control none --kernel-name regex:fc1_prefill --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    --section ComputeWorkloadAnalysis ${NCU_ARGS:-} python3 tools/profile_decode.py --preset mixtral-8x7b \
    --tokens 4096 --decode-max-routes 0 --calls 2 2>&1 | tee "$OUT/ncu.txt" | grep -vE "^==PROF==|^ *-+ *$" | tail -90
fi
stamp done
