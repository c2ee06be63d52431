"""Decode vs prefill engine on the same layer, by token count (GPU needed): graph replay, L2 flushed,
median; the two outputs must agree within the dtype's tolerance. Finds the switch point per shape.

    python -m qmoe_rtc bench crossover --preset qwen3-30b-a3b,mixtral-8x7b --tokens 4,8,16,32,64,128
"""

from __future__ import annotations

import argparse
import statistics
import sys


def build_parser() -> argparse.ArgumentParser:
    from ..cli_args import csv, names, positive
    from .report import BENCH_SHAPES

    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench crossover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", type=names(BENCH_SHAPES, "bench shape"),
                   default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048",
                   help="comma list of bench shapes (default: qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048)")
    p.add_argument("--tokens", type=csv(positive), default="4,8,16,32,64,128",
                   help="comma list of token counts (default: 4,8,16,32,64,128)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="activation dtype")
    p.add_argument("--iters", type=int, default=30, help="samples per point (default: 30)")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from ..jit.driver import probe

    probe(0)  # no driver, no GPU: one line (a DeviceError) before CuPy is asked
    import cupy as cp
    import numpy as np

    from .._arrays import np_dtype
    from ..executor import QMoE
    from .layers import build_layer
    from .report import BENCH_SHAPES, TOL, rel_err
    from .run import Timer

    timer = Timer(cp)
    bad = 0
    for name in a.preset:
        shape = BENCH_SHAPES[name]
        rs = cp.random.RandomState(1)
        weights, attrs = build_layer(cp, rs, shape, a.dtype, (4, 4), shape.block_size, False)
        layers = {path: QMoE(**weights, **attrs, decode_max_routes=limit) for path, limit in (("decode", 512),
                                                                                                ("prefill", 0))}
        default = QMoE(**weights, **attrs)
        for T in a.tokens:
            x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype(a.dtype))
            lg = 2 * rs.standard_normal((T, shape.E), dtype=cp.float32)
            us, outs = {}, {}
            for path, moe in layers.items():
                if T * shape.k > 512 and path == "decode":
                    continue
                g = moe.capture(x, lg)
                us[path] = statistics.median(timer.samples_us(g.replay, a.iters, 3))
                outs[path] = cp.asnumpy(g.output).astype(np.float32)
            diff = rel_err(outs["prefill"], outs["decode"]) if len(outs) == 2 else 0.0
            bad += diff > TOL[a.dtype]
            winner = min(us, key=us.get)
            print(f"{name:<16} T={T:<5} routes={T * shape.k:<6} decode {us.get('decode', float('nan')):9.1f} us  "
                  f"prefill {us['prefill']:9.1f} us  faster: {winner:<8} default: {default.path_for(T):<8} "
                  f"diff {diff:.1e}", flush=True)
        del layers, default
        cp.get_default_memory_pool().free_all_blocks()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
