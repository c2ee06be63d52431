"""Compile, in parallel, every module the GPU test suites will load (run on the GPU host before
pytest, so the tests do not compile one module at a time). No GPU needed with --arch.

    python tools/precompile.py --arch sm_90 [--jobs 16] [--suites test_fp4_gpu,test_mma_prefill_gpu]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests")
sys.path.insert(0, TESTS)  # the suites import tests/support

SUITES = ("test_executor_gpu", "test_mma_decode_gpu", "test_mma_prefill_gpu", "test_expert_flow_gpu", "test_route_order_gpu",
          "test_fp4_gpu")
EXECUTOR_FAMILIES = ("route", "gemv", "gemm", "mma_decode", "mma_batched", "mma_prefill", "wgmma_prefill")


def specs(suites=SUITES) -> list:
    import numpy as np

    from qmoe_rtc.settings import knobs

    seen: dict = {}
    rng = np.random.default_rng(0)
    for name in suites:
        mod = _suite(name)
        sets = getattr(mod, "PRECOMPILE_KNOBS", {})  # a suite's code-changing knobs: one set or a list of sets
        for kn in sets if isinstance(sets, list) else [sets]:
            with knobs.scope(**kn):
                _add_specs(mod.LAYERS, rng, seen)
    return list(seen)


def _suite(name: str):
    """A GPU suite, imported from its file under tests/<area>/ (as pytest imports it: by its own name)."""
    import glob
    import importlib.util

    found = glob.glob(os.path.join(TESTS, "*", f"{name}.py"))
    if len(found) != 1:
        raise SystemExit(f"precompile: suite {name} is not one file under tests/<area>/ ({found})")
    spec = importlib.util.spec_from_file_location(name, found[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _add_specs(layers, rng, seen: dict) -> None:
    """The module specs of every (layer, dtype) case of a suite's LAYERS, added to ``seen``."""
    from qmoe_rtc.contract import QMoEAttributes, describe_layer
    from qmoe_rtc.contract.random_layer import random_layer
    from qmoe_rtc.executor import layer_config
    from qmoe_rtc.kernels import get_family
    from qmoe_rtc.runtime.layer import executor_config

    for case in layers:
        kw, E, H, I = case[1], case[2], case[3], case[4]
        dtypes = [case[5]] if len(case) > 5 else ["float16", "bfloat16"]
        for dtype in dtypes:
            kw2 = dict(kw)
            k = kw2.pop("k")
            w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw2)
            layer = describe_layer(w, QMoEAttributes.from_kwargs(**a))
            sdt = {p.scale_dtype for p in layer.projections()}
            cfg = executor_config(layer_config(layer, dtype, sdt.pop() if len(sdt) == 1 else "float32"))
            for fam in EXECUTOR_FAMILIES:
                f = get_family(fam)
                if f.supports(cfg) is None:
                    for s in f.specs(cfg):
                        seen.setdefault(s, None)


def main() -> int:
    from qmoe_rtc.cli.warm import _build
    from qmoe_rtc.settings import knobs

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", required=True)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma list of GPU suites (default: {','.join(SUITES)})")
    args = p.parse_args()
    suites = tuple(s.strip() for s in args.suites.split(",") if s.strip())
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        p.error(f"--suites: {unknown} are not among {list(SUITES)}")
    todo = specs(suites)
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    failed = 0
    with cf.ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx, initializer=knobs.apply,
                                initargs=(knobs.snapshot(),)) as pool:
        futs = {pool.submit(_build, s, args.arch): s for s in todo}
        for fut in cf.as_completed(futs):
            try:
                fut.result()
            except Exception as exc:  # reported, counted, exit code says it
                failed += 1
                print(f"FAILED {futs[fut].name}: {exc}", flush=True)
    print(f"precompiled {len(todo)} modules for {args.arch} in {time.perf_counter() - t0:.1f} s "
          f"({args.jobs} workers), {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
