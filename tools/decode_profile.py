"""One decode step of a bench shape, a few times, for a per-kernel view under ncu (issue 13):

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__waves_per_multiprocessor \
        --csv python3 tools/decode_profile.py qwen3-30b-a3b 1 [bits]

Prints the plan (each step's kernel, grid and launch scalars) so the ncu rows can be read against it.
"""

from __future__ import annotations

import sys

import cupy as cp

from qmoe_rtc.bench_layers import build_layer
from qmoe_rtc.bench_report import BENCH_SHAPES
from qmoe_rtc.executor import QMoE


def main() -> None:
    name, rows = sys.argv[1], int(sys.argv[2])
    bits = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    shape = BENCH_SHAPES[name]
    rs = cp.random.RandomState(0)
    w, a = build_layer(cp, rs, shape, "bfloat16", (bits, bits), shape.block_size, False)
    x = cp.asarray(rs.standard_normal((rows, shape.H)), dtype=cp.float32).astype(w["fc1_scales"].dtype)
    lg = cp.asarray(2 * rs.standard_normal((rows, shape.E)), dtype=cp.float32)
    moe = QMoE(**w, **a)
    out = cp.empty_like(x)
    for _ in range(3):
        moe(x, lg, out=out)
    cp.cuda.Device().synchronize()
    plan = moe.plan(rows, "bfloat16", "float32")
    print(name, rows, bits, plan.engine, [(s.role, s.kernel.kdef.key, s.launch.grid, s.launch.args) for s in plan.steps],
          flush=True)


if __name__ == "__main__":
    main()
