#!/usr/bin/env bash
# One device call: the wgmma prefill tests on a subset of layouts with 2 and 4 warpgroups per block, then
# tools/prefill_sweep.py over the wgmma knobs on mixtral-8x7b and qwen3-30b-a3b (outputs compared bitwise).
export PYTHONPATH=$PWD QMOE_RTC_CACHE_DIR=/tmp/qc PYTHONUNBUFFERED=1
python3 tools/precompile.py --arch sm_90 --jobs 16 2>&1 | tail -1
K="wgmma and (b4-bs32 or mixed-4-8 or f32-scales or b8-rowwise or route_tiles)"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_mma_prefill_gpu.py -k "$K" 2>&1 | tail -2
QMOE_RTC_PREFILL_WG_GROUPS=4 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/test_mma_prefill_gpu.py -k "$K" 2>&1 | tail -2
for p in mixtral-8x7b qwen3-30b-a3b; do
QMOE_RTC_PREFILL_ENGINE=wgmma timeout 200 python3 tools/prefill_sweep.py --preset $p --tokens 512,4096 --grid prefill_wg_groups=2,4 --grid prefill_route_tile=128,256 --grid prefill_wg_stages=3,4 2>&1 | grep -v Warn
done
