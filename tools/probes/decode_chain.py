"""One bench layer's forwards at a few token counts, inside a profiler range: the driver for ncu readings of a
forward's kernels (``ncu --profile-from-start off``), which profiles nothing of the layer's build.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python tools/probes/decode_chain.py --preset qwen3-30b-a3b --tokens 1,2
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--repeat", type=int, default=1, help="forwards per token count inside the range")
    ap.add_argument("--swiglu-fusion", type=int, default=2, choices=(1, 2),
                    help="swiglu layers' FC1 layout (default 2: the peers benchmark's layer)")
    a = ap.parse_args()
    import cupy as cp

    from qmoe_rtc._arrays import np_dtype
    from qmoe_rtc.bench.layers import build_layer
    from qmoe_rtc.bench.report import BENCH_SHAPES
    from qmoe_rtc.contract.extensions import EXT_INPUTS
    from qmoe_rtc.executor import QMoE

    shape = BENCH_SHAPES[a.preset]
    rs = cp.random.RandomState(0)
    w, at = build_layer(cp, rs, shape, "bfloat16", (4, 4), shape.block_size, False, swiglu_fusion=a.swiglu_fusion)
    moe = QMoE(**{n: v for n, v in w.items() if n not in EXT_INPUTS}, **at)
    calls = []
    for T in (int(t) for t in a.tokens.split(",")):
        x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype("bfloat16"))
        logits = cp.asarray(2 * rs.standard_normal((T, shape.E)), dtype=cp.float32)
        moe(x, logits)  # compile and plan outside the range
        calls.append((T, x, logits))
    cp.cuda.get_current_stream().synchronize()
    cp.cuda.profiler.start()
    for _T, x, logits in calls:
        for _ in range(a.repeat):
            moe(x, logits)
    cp.cuda.get_current_stream().synchronize()
    cp.cuda.profiler.stop()
    print("done", a.preset, a.tokens, [moe.engine_for(T, "bfloat16").pipeline.name for T, _, _ in calls])


if __name__ == "__main__":
    main()
