"""A few eager forwards of a bench-shaped layer, for a profiler to look at (decode or, with
``--decode-max-routes 0``, prefill), then one line per layer with its pipeline and each step's
kernel, grid and launch scalars, so the profiler's rows can be read against them:

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__warps_active.avg.pct_of_peak_sustained_active,launch__waves_per_multiprocessor \
        --csv python3 tools/profile_decode.py --preset qwen3-30b-a3b --tokens 1
    ncu --clock-control none --section SpeedOfLight python3 tools/profile_decode.py --preset mixtral-8x7b
"""

from __future__ import annotations

import argparse

import cupy as cp

from qmoe_rtc.bench_layers import build_layer
from qmoe_rtc.bench_report import BENCH_SHAPES
from qmoe_rtc.executor import QMoE


def activations(rs, rows: int, H: int, dtype) -> cp.ndarray:
    """[rows, H] standard-normal activations of the layer's dtype (bfloat16 as its uint16 bits, truncated)."""
    x = rs.standard_normal((rows, H), dtype=cp.float32)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16) if dtype == cp.uint16 else x.astype(dtype)


def run_steps(label: str, moe, x, logits, calls: int = 3) -> None:
    """``calls`` forwards of ``moe``, then one line naming its pipeline and each step's kernel, grid
    and launch scalars (what the profiler's rows are)."""
    out = cp.empty_like(x)
    for _ in range(calls):
        moe(x, logits, out=out)
    cp.cuda.Device().synchronize()
    dtype = "bfloat16" if x.dtype == cp.uint16 else str(x.dtype)
    plan = moe.plan(x.shape[0], dtype, "float32")
    print(label, plan.engine, [(s.role, s.kernel.kdef.key, s.launch.grid, s.launch.args) for s in plan.steps],
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b", choices=sorted(BENCH_SHAPES))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--decode-max-routes", type=int, default=None, help="the decode/prefill switch (0: prefill)")
    a = p.parse_args()
    shape = BENCH_SHAPES[a.preset]
    rs = cp.random.RandomState(0)
    w, at = build_layer(cp, rs, shape, a.dtype, (a.bits, a.bits), shape.block_size, False)
    x = activations(rs, a.tokens, shape.H, w["fc1_scales"].dtype)
    lg = cp.asarray(2 * rs.standard_normal((a.tokens, shape.E)), dtype=cp.float32)
    moe = QMoE(**w, **at, decode_max_routes=a.decode_max_routes)
    run_steps(f"{a.preset} tokens={a.tokens} bits={a.bits}", moe, x, lg, a.calls)


if __name__ == "__main__":
    main()
