"""Warm the kernel cache for a model: ``python -m qmoe_rtc warm ...`` / ``tools/warm_cache.py``.

Collects the unique modules with :func:`qmoe_rtc.kernels.modules_for` (the pipelines the executor
chooses from), compiles them for every ``--arch`` in spawned worker processes, prints one line per
module (arch, name, hit/compiled, ms) and a summary; exits non-zero if anything failed. No GPU is
needed when ``--arch`` is given.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "build_parser", "plan"]


def _csv(kind):
    def parse(text: str):
        return [kind(x) for x in text.split(",") if x.strip()]

    return parse


def build_parser() -> argparse.ArgumentParser:
    from .presets import PRESETS
    from .specialize import ACTIVATIONS, DTYPES, ZP_MODES

    p = argparse.ArgumentParser(prog="qmoe_rtc warm", description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model (a preset, or explicit shapes)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="model preset")
    src.add_argument("--hidden", type=int)
    src.add_argument("--inter", type=int)
    src.add_argument("--experts", type=int)
    src.add_argument("--k", type=int)
    q = p.add_argument_group("quantization / codegen (comma lists give every combination)")
    q.add_argument("--bits", type=_csv(int), help="bits for every projection, e.g. 4 or 2,4 (default: preset's, else 4)")
    q.add_argument("--fc1-bits", type=int)
    q.add_argument("--fc2-bits", type=int)
    q.add_argument("--fc3-bits", type=int)
    q.add_argument("--block-size", type=_csv(int), help="0 = row-wise (default: preset's, else 0)")
    q.add_argument("--zero-points", type=_csv(str), default=["none"], help=f"comma list of {list(ZP_MODES)}")
    q.add_argument("--dtype", type=_csv(str), default=["float16"], help=f"comma list of {list(DTYPES)}")
    q.add_argument("--scale-dtype", default="", help="float32 or the activation dtype (default: activation dtype)")
    q.add_argument("--activation", choices=ACTIVATIONS)
    q.add_argument("--swiglu-fusion", type=int, choices=(0, 1, 2))
    q.add_argument("--fc3", action="store_true", default=None, help="the layer has FC3 (separate linear/up projection)")
    q.add_argument("--variants", type=_csv(str), default=["decode", "prefill"])
    r = p.add_argument_group("run")
    r.add_argument("--arch", action="append", help="sm_80, sm_86, sm_89, sm_90, sm_90a (repeatable; default: this GPU's)")
    r.add_argument("--jobs", "-j", type=int, default=None, help="worker processes (default: $QMOE_RTC_JOBS or CPUs)")
    r.add_argument("--cache-dir", help="cache directory (overrides $QMOE_RTC_CACHE_DIR)")
    r.add_argument("--list", action="store_true", help="print the plan and exit")
    r.add_argument("--dry-run", action="store_true", help="same as --list")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _configs(args) -> list:
    """Every ModelConfig the arguments describe."""
    from .errors import QMoEAttributeError
    from .presets import Preset, get_preset

    if args.preset:
        base = get_preset(args.preset)
        for f in ("hidden", "inter", "experts", "k"):
            if getattr(args, f) is not None:
                base = Preset(**{**base.__dict__, f: getattr(args, f)})
    else:
        missing = [f"--{f}" for f in ("hidden", "inter", "experts", "k") if getattr(args, f) is None]
        if missing:
            raise QMoEAttributeError("model", "--preset or all of --hidden --inter --experts --k", f"missing {missing}")
        act = args.activation or "swiglu"
        gated = act in ("swiglu", "geglu")
        fusion = args.swiglu_fusion if args.swiglu_fusion is not None else (1 if gated and not args.fc3 else 0)
        base = Preset("custom", args.hidden, args.inter, args.experts, args.k, act, swiglu_fusion=fusion,
                      has_fc3=bool(args.fc3))
    out = []
    for dtype in args.dtype:
        for bits in (args.bits or [None]):
            for bs in (args.block_size or [None]):
                for zp in args.zero_points:
                    out.append(base.config(bits=bits, fc1_bits=args.fc1_bits, fc2_bits=args.fc2_bits,
                                           fc3_bits=args.fc3_bits, block_size=bs, zero_points=zp, dtype=dtype,
                                           scale_dtype=args.scale_dtype,
                                           activation=args.activation if args.preset else None,
                                           swiglu_fusion=args.swiglu_fusion if args.preset else None,
                                           has_fc3=args.fc3 if args.preset else None))
    return out


def plan(configs, archs: Sequence[str], variants=("decode", "prefill")) -> list[tuple]:
    """Unique (spec, arch) pairs to build, in a stable order."""
    from .kernels import modules_for

    seen: dict = {}
    for arch in archs:
        for cfg in configs:
            for spec in modules_for(cfg, variants):
                seen.setdefault((spec, arch), None)
    return list(seen)


def _build(spec, arch):
    """Worker: fetch or compile one module. Returns (origin, ms, cubin bytes)."""
    from .jit import get_cubin
    from .kernels import spec_unit

    t0 = time.perf_counter()
    mod = get_cubin(spec_unit(spec), arch)
    return mod.origin, (time.perf_counter() - t0) * 1e3, len(mod.cubin)


def _progress(done: int, total: int, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    from . import knobs
    from .errors import QMoEError
    from .jit import check_arch, default_arch

    args = build_parser().parse_args(argv)
    overrides = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    with knobs.scope(**overrides):
        try:
            archs = [check_arch(a) for a in (args.arch or [])] or [default_arch()]
            configs = _configs(args)
            todo = plan(configs, archs, tuple(args.variants))
        except QMoEError as exc:
            print(f"qmoe_rtc warm: {exc}", file=sys.stderr)
            return 2
        if args.list or args.dry_run:
            for cfg in configs:
                print(f"# {cfg.name} H{cfg.hidden} I{cfg.inter} E{cfg.experts} k{cfg.k}: {cfg.layout.name}")
            for spec, arch in todo:
                print(f"{arch} {spec.name}")
            print(f"{len(todo)} modules, {len(archs)} arch(s), cache {knobs.cache_dir()} ({knobs.cache_mode()})")
            return 0

        jobs = args.jobs or knobs.get("jobs") or os.cpu_count() or 1
        jobs = max(1, min(jobs, len(todo)))
        show = not args.no_progress and sys.stderr.isatty()
        t0 = time.perf_counter()
        results: dict = {}
        failures = []

        def report(i, spec, arch, res):
            if isinstance(res, BaseException):
                failures.append((spec, arch, res))
                print(f"{arch} {spec.name} FAILED {type(res).__name__}: {str(res).splitlines()[0] if str(res) else ''}",
                      flush=True)
            else:
                origin, ms, size = res
                status = "compiled" if origin == "compiled" else "hit"
                print(f"{arch} {spec.name} {status} {ms:.1f} ms ({size} B)", flush=True)
            results[(spec, arch)] = res
            _progress(len(results), len(todo), show)

        if jobs == 1:
            for i, (spec, arch) in enumerate(todo):
                try:
                    res = _build(spec, arch)
                except Exception as exc:  # reported per module, exit code says it
                    res = exc
                report(i, spec, arch, res)
        else:
            ctx = multiprocessing.get_context("spawn")
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=knobs.apply,
                                        initargs=(knobs.snapshot(),)) as pool:
                futs = {pool.submit(_build, spec, arch): (i, spec, arch) for i, (spec, arch) in enumerate(todo)}
                for fut in cf.as_completed(futs):
                    i, spec, arch = futs[fut]
                    try:
                        res = fut.result()
                    except Exception as exc:
                        res = exc
                    report(i, spec, arch, res)

        wall = time.perf_counter() - t0
        ok = [r for r in results.values() if not isinstance(r, BaseException)]
        compiled = sum(1 for r in ok if r[0] == "compiled")
        print(f"warmed {len(todo)} modules for {','.join(archs)}: {compiled} compiled, {len(ok) - compiled} hits, "
              f"{len(failures)} failed in {wall:.2f} s ({jobs} workers); cache {knobs.cache_dir()}")
        for spec, arch, exc in failures:
            print(f"--- {arch} {spec.name}: {exc}", file=sys.stderr)
            numbered = getattr(exc, "numbered_source", None)
            if callable(numbered):
                print(numbered(), file=sys.stderr)
        return 1 if failures else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
