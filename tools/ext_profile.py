"""Per-kernel view of one decode step of a preset with shared experts / the router GEMM (issue 12): runs
the routed-only, +shared and full layers a few times each, for ``ncu --metrics gpu__time_duration.sum``.

    ncu --metrics gpu__time_duration.sum --csv python3 tools/ext_profile.py qwen3-next-80b-a3b 1
"""

from __future__ import annotations

import sys

import cupy as cp
from profile_decode import activations, run_steps

from qmoe_rtc.bench_layers import build_layer
from qmoe_rtc.bench_report import BENCH_SHAPES
from qmoe_rtc.executor import QMoE
from qmoe_rtc.extensions import EXT_INPUTS


def main() -> None:
    name, rows = sys.argv[1], int(sys.argv[2])
    shape = BENCH_SHAPES[name]
    rs = cp.random.RandomState(0)
    w, a = build_layer(cp, rs, shape, "bfloat16", (4, 4), 128, False, shared=True)
    routed = {n: v for n, v in w.items() if n not in EXT_INPUTS}
    shared = {n: v for n, v in w.items() if n not in ("router_weight", "router_bias")}
    x = activations(rs, rows, shape.H, w["fc1_scales"].dtype)
    lg = cp.asarray(2 * rs.standard_normal((rows, shape.E)), dtype=cp.float32)
    for label, ws, logits in (("routed", routed, lg), ("shared", shared, lg), ("full", w, None)):
        run_steps(label, QMoE(**ws, **a), x, logits)


if __name__ == "__main__":
    main()
