"""Small forwards through every engine, for compute-sanitizer (memcheck / racecheck / synccheck /
initcheck) to watch: each layout of the stress check (``qmoe_rtc.cli.stress.LAYOUTS``: every bit width and
FP8, row / block scales, zero points, GLU and plain activations, FC3, shared experts, the router GEMM,
float16 / bfloat16 / float32) on each engine it runs (decode-mma, prefill-batched, prefill-mma, prefill-wgmma on
sm_90, decode-gemv, prefill-simt), one decode-sized and one prefill-sized call, checked against the float64
reference.

    compute-sanitizer --tool racecheck python tools/sanitize_case.py [--layouts a,b] [--engines e,f] [--rows 3,70]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main(argv=None) -> int:
    from qmoe_rtc.cli.args import csv, names
    from qmoe_rtc.cli.stress import ENGINES, LAYOUTS, cases

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", type=names([lay[0] for lay in LAYOUTS], "layout"), help="default: all")
    p.add_argument("--engines", type=names(ENGINES, "engine"), help="default: all this GPU has")
    p.add_argument("--rows", type=csv(int), default=[3, 70], help="row counts per case (default 3,70)")
    args = p.parse_args(argv)

    import cupy as cp

    from qmoe_rtc.bench.report import TOL, rel_err
    from qmoe_rtc.cli.stress_gpu import build_layer, engine_scope, ran_engine
    from qmoe_rtc.contract.random_layer import random_inputs
    from qmoe_rtc.contract.reference import qmoe as reference

    rng = np.random.default_rng(0)
    failed, ran = [], {}
    for case in cases(args.layouts, args.engines, cp.cuda.Device().compute_capability == "90"):
        (name, kw, E, H, I, dtype), engine = case
        moe, w, a = build_layer(cp, rng, case)
        router_gemm = "router_weight" in w
        with engine_scope(engine):
            for rows in args.rows:
                if engine.startswith("decode") and rows * (kw["k"] + kw.get("shared", 0)) > 512:
                    continue
                x, lg, _ = random_inputs(rng, rows, H, E, dtype)
                out = cp.full(x.shape, cp.nan, x.dtype)
                moe(cp.asarray(x), None if router_gemm else cp.asarray(lg), out=out)
                want = reference(x, None if router_gemm else lg, **w, **a)
                err = rel_err(cp.asnumpy(out), want)
                eng = ran_engine(moe, rows, dtype)
                ran[eng] = ran.get(eng, 0) + 1
                if not err <= TOL[dtype]:
                    failed.append(f"{name} {eng} rows={rows}: rel err {err:.2e}")
    cp.cuda.Device().synchronize()
    print("sanitize_case: forwards per engine " + ", ".join(f"{e} {n}" for e, n in sorted(ran.items())))
    for f in failed:
        print("FAILED " + f)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
