"""A few small forwards through every engine (both prefill engines on sm_90), for compute-sanitizer
(memcheck / racecheck / synccheck) to watch:

    compute-sanitizer --tool memcheck python tools/sanitize_case.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main() -> int:
    import cupy as cp

    from qmoe_rtc import knobs
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.random_layer import random_inputs, random_layer
    from qmoe_rtc.reference import qmoe as reference

    rng = np.random.default_rng(0)
    worst = 0.0
    for dtype, kw, E, H, I in (("bfloat16", dict(bits=4, block_size=32, zero_points=True), 8, 160, 96),
                               ("float16", dict(bits=8, block_size=0), 8, 128, 64),
                               ("float16", dict(bits=2, block_size=16, zero_points=True, fc3=True, swiglu_fusion=0), 8,
                                128, 64)):
        w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype=dtype, activation_type="swiglu", **kw)
        for limit, engine in ((0, "mma"), (0, "wgmma"), (512, "auto")):  # prefill on both engines, decode
            if engine == "wgmma" and cp.cuda.Device().compute_capability != "90":
                continue
            with knobs.scope(prefill_engine=engine):
                moe = QMoE(**{n: cp.asarray(v) for n, v in w.items()}, **a, decode_max_routes=limit)
                for rows in (3, 70):
                    x, lg, _ = random_inputs(rng, rows, H, E, dtype)
                    y = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg))).astype(np.float64)
                    want = reference(x, lg, **w, **a).astype(np.float64)
                    worst = max(worst, float(np.linalg.norm(y - want) / np.linalg.norm(want)))
    cp.cuda.Device().synchronize()
    print(f"sanitize_case: worst rel err {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
