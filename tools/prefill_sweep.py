"""Time the prefill engine under tuning-knob variants on one layer (GPU needed): every variant's output
must equal the first one's bitwise (the per-element arithmetic does not depend on the tiling).

    python tools/prefill_sweep.py --preset mixtral-8x7b --tokens 4096 \
        --grid prefill_warps=4,8 --grid prefill_stages=2,3,4 --grid prefill_group=4,8,16
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main() -> int:
    import cupy as cp

    from qmoe_rtc import knobs
    from qmoe_rtc._arrays import np_dtype
    from qmoe_rtc.bench import BENCH_SHAPES, Timer, build_layer, flop_count
    from qmoe_rtc.executor import QMoE

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="mixtral-8x7b")
    p.add_argument("--tokens", default="4096")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--grid", action="append", default=[], help="knob=v1,v2,... (repeatable)")
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()
    shape = BENCH_SHAPES[a.preset]
    rs = cp.random.RandomState(0)
    weights, attrs = build_layer(cp, rs, shape, a.dtype, (4, 4), shape.block_size, False)
    names = [g.split("=")[0] for g in a.grid]
    values = [[int(v) for v in g.split("=")[1].split(",")] for g in a.grid]
    timer = Timer(cp)
    for T in (int(t) for t in a.tokens.split(",")):
        x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype(a.dtype))
        lg = 2 * rs.standard_normal((T, shape.E), dtype=cp.float32)
        first = None
        for combo in itertools.product(*values) if values else [()]:
            with knobs.scope(**dict(zip(names, combo))):
                moe = QMoE(**weights, **attrs, decode_max_routes=0)
                out = cp.empty_like(x)
                moe(x, lg, out=out)
                g = moe.capture(x, lg, out=out)
            cp.cuda.Device().synchronize()
            got = cp.asnumpy(out).view(np.uint16)
            same = first is None or np.array_equal(got, first)
            first = got if first is None else first
            us = statistics.median(timer.samples_us(g.replay, a.iters, 3))
            tflops = flop_count(T, shape.k, shape.H, shape.I) / us / 1e6
            label = " ".join(f"{n}={v}" for n, v in zip(names, combo)) or "default"
            print(f"{a.preset} T={T} {label:<50} {us:9.1f} us {tflops:6.1f} TFLOP/s"
                  f"{'' if same else '  OUTPUT DIFFERS'}", flush=True)
            del moe, g
            cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
