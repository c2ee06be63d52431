"""Run a few eager forwards of a preset-shaped layer, for a profiler (ncu) to look at.

    ncu --clock-control none --section SpeedOfLight python tools/profile_decode.py --preset mixtral-8x7b --tokens 1
"""

from __future__ import annotations

import argparse

import numpy as np


def main() -> None:
    import cupy as cp

    from qmoe_rtc.bench import BENCH_SHAPES as SHAPES
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.quantize import quantize

    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--decode-max-routes", type=int, default=64)
    a = p.parse_args()
    s = SHAPES[a.preset]
    H, I, E, k = s.H, s.I, s.E, s.k
    bs = s.block_size

    def q(N, K):
        w = cp.random.standard_normal((E, N, K), dtype=cp.float32) / np.float32(np.sqrt(K))
        return quantize(w, 4, bs, scale_dtype=np.float16)

    w1, w2 = q(2 * I, H), q(H, I)
    moe = QMoE(fc1_experts_weights=w1.packed, fc1_scales=w1.scales, fc2_experts_weights=w2.packed,
               fc2_scales=w2.scales, k=k, activation_type="swiglu", swiglu_fusion=1, block_size=bs,
               normalize_routing_weights=1, decode_max_routes=a.decode_max_routes)
    x = cp.random.standard_normal((a.tokens, H), dtype=cp.float32).astype(cp.float16)
    lg = cp.random.standard_normal((a.tokens, E), dtype=cp.float32)
    for _ in range(a.calls):
        moe(x, lg)
    cp.cuda.Device().synchronize()
    print("path:", moe.path_for(a.tokens))


if __name__ == "__main__":
    main()
