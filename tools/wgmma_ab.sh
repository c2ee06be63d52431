#!/usr/bin/env bash
# One device call: the wgmma prefill tests on a layout subset (built-in knobs), then tools/prefill_sweep.py
# over one wgmma knob (GRID, default the MMAs in flight) on mixtral-8x7b and qwen3-30b-a3b, outputs compared
# bitwise with the first variant.   GRID="prefill_wg_inflight=1,2" bash tools/wgmma_ab.sh
export PYTHONPATH=$PWD QMOE_RTC_CACHE_DIR=/tmp/qc PYTHONUNBUFFERED=1
python3 tools/precompile.py --arch sm_90 --jobs 16 2>&1 | tail -1
K="wgmma and (b4-bs32 or mixed-4-8 or f32-scales or b8-rowwise or b1-bs32 or route_tiles)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_mma_prefill_gpu.py -k "$K" 2>&1 | tail -2
for p in mixtral-8x7b:4096 qwen3-30b-a3b:512,4096 gpt-oss-120b:4096; do
  QMOE_RTC_PREFILL_ENGINE=wgmma timeout 120 python3 tools/prefill_sweep.py --preset "${p%%:*}" --tokens "${p#*:}" \
    --grid "${GRID:-prefill_wg_inflight=1,2}" 2>&1 | grep -v Warn
done
