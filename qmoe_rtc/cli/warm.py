"""Warm the kernel cache for a model: ``python -m qmoe_rtc warm ...``.

Collects the unique modules with :func:`qmoe_rtc.kernels.modules_for` (the pipelines the executor
chooses from), builds them for every ``--arch`` in spawned worker processes (which die with the warm
process), and checks that each one is then on disk, intact and loadable by the cache. Prints one
line per module (arch, name, stored/hit/FAILED, ms) and a summary with the stored / hit / failed
counts. Exit status: 0 when every planned module is on disk, 1 when any is not, 2 for bad arguments,
bad knob values or a cache directory that cannot store (warm never falls back to memory: storing is
its job). No GPU is needed when ``--arch`` is given.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from .args import csv, positive

__all__ = ["main", "build_parser", "plan"]

_EXAMPLES = """examples:
  python -m qmoe_rtc warm --preset qwen3-30b-a3b --dtype bfloat16 --arch sm_90
  python -m qmoe_rtc warm --preset mixtral-8x7b --dtype float16,bfloat16 --zero-points none,packed --arch sm_90 --arch sm_80
  python -m qmoe_rtc warm --hidden 4096 --inter 14336 --experts 8 --k 2 --bits 4 --block-size 128 --arch sm_90 --list
  python -m qmoe_rtc warm --preset qwen3-next-80b-a3b --dtype bfloat16 --arch sm_90   (shared expert + router GEMM)
  python -m qmoe_rtc warm --preset deepseek-v3-tp8 --format int,fp8_e4m3 --dtype bfloat16 --arch sm_90

exit status: 0 every planned module is on disk and loads; 1 some module failed or was not stored;
2 bad arguments, a bad QMOE_RTC_* value, or a cache directory that cannot store.
"""


def build_parser() -> argparse.ArgumentParser:
    from ..formats.axis import FORMATS
    from ..specialize import ACTIVATIONS, DTYPES, ZP_MODES
    from ..specialize.presets import PRESETS

    p = argparse.ArgumentParser(
        prog="python -m qmoe_rtc warm", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EXAMPLES,
        description="Pre-compile the kernels a model's layers use into the on-disk kernel cache, then check\n"
                    "that every one of them is stored there. No GPU is needed when --arch is given.")
    src = p.add_argument_group("model (--preset, or all of --hidden --inter --experts --k)")
    src.add_argument("--preset", choices=sorted(PRESETS), metavar="NAME",
                     help=f"model preset: {', '.join(sorted(PRESETS))}")
    src.add_argument("--hidden", type=int, metavar="H", help="hidden size H (overrides the preset's)")
    src.add_argument("--inter", type=int, metavar="I", help="intermediate size I of one expert (overrides the preset's)")
    src.add_argument("--experts", type=int, metavar="E", help="number of experts E (overrides the preset's)")
    src.add_argument("--k", type=int, metavar="K", help="experts per token k (overrides the preset's)")
    src.add_argument("--shared", type=int, metavar="S", help="shared experts, intermediate size I (default: the "
                                                             "preset's, else 0; 0 also drops the gate)")
    src.add_argument("--shared-gate", action=argparse.BooleanOptionalAction, default=None,
                     help="the shared experts' sum is scaled by sigmoid(x·g) (default: the preset's)")
    src.add_argument("--router-gemm", action=argparse.BooleanOptionalAction, default=None,
                     help="the layer computes its logits from router_weight in the activation dtype (default: the "
                          "preset's)")
    src.add_argument("--scoring-func", choices=("softmax", "sigmoid"), default=None,
                     help="[ext] the routing's scores: 'sigmoid' for grouped sigmoid routing (DeepSeek-V3, Kimi-K2, "
                          "GLM-4.5; default: the preset's, else softmax)")
    src.add_argument("--n-group", type=int, metavar="G", help="[ext] expert groups of grouped sigmoid routing "
                     "(default: the preset's, else none)")
    src.add_argument("--expert-counts", action="store_true", help="[ext] the layers count their experts' routes "
                     "(QMoE(expert_counts=True)): routing modules that count")
    q = p.add_argument_group("quantization / codegen (comma lists give every combination)")
    q.add_argument("--format", type=csv(str), default=["int"], metavar="FMT[,FMT...]",
                   help=f"weight formats, from {', '.join(FORMATS)} (default: int); fp8_e4m3: FP8 e4m3 experts "
                        "(8-bit codes, no zero points: --bits and --zero-points do not apply; float32 scales unless "
                        "--scale-dtype; --block-size 0 = one global scale per expert); mxfp4 / nvfp4: FP4 e2m1 "
                        "experts (4-bit, blocks of 32 / 16, float32 scales on the device). The old spelling fp8 "
                        "is refused, naming fp8_e4m3")
    q.add_argument("--bits", type=csv(int), metavar="B[,B...]",
                   help="bits of every projection, e.g. 4 or 2,4 (default: the preset's, else 4)")
    q.add_argument("--fc1-bits", type=int, metavar="B", help="bits of FC1 only (default: --bits)")
    q.add_argument("--fc2-bits", type=int, metavar="B", help="bits of FC2 only (default: --bits)")
    q.add_argument("--fc3-bits", type=int, metavar="B", help="bits of FC3 only, with --fc3 (default: --bits)")
    q.add_argument("--block-size", type=csv(int), metavar="BS[,BS...]",
                   help="quantization block size; 0 = one scale per row (default: the preset's, else 0)")
    q.add_argument("--zero-points", type=csv(str), default=["none"], metavar="MODE[,MODE...]",
                   help=f"zero-point modes, from {', '.join(ZP_MODES)} (default: none)")
    q.add_argument("--dtype", type=csv(str), default=["float16"], metavar="DTYPE[,DTYPE...]",
                   help=f"activation dtypes, from {', '.join(DTYPES)} (default: float16)")
    q.add_argument("--scale-dtype", default="", metavar="DTYPE",
                   help="dtype of the scales: float32 or the activation dtype (default: the activation dtype)")
    q.add_argument("--activation", choices=ACTIVATIONS, metavar="ACT",
                   help=f"activation: {', '.join(ACTIVATIONS)} (default: the preset's, else swiglu)")
    q.add_argument("--swiglu-fusion", type=int, choices=(0, 1, 2),
                   help="gate/linear rows of FC1: 1 interleaved, 2 halves, 0 linear half from FC3 "
                        "(default: the preset's, else 1 for swiglu/geglu without --fc3)")
    q.add_argument("--fc3", action="store_true", default=None, help="the layer has FC3 (a separate linear/up projection)")
    q.add_argument("--variants", type=csv(str), default=["decode", "prefill"], metavar="PATH[,PATH...]",
                   help="paths to build: decode, prefill (default: both)")
    r = p.add_argument_group("run")
    r.add_argument("--arch", action="append", metavar="sm_XX",
                   help="target: sm_80, sm_86, sm_89, sm_90, sm_90a (repeat for several; default: this machine's GPU)")
    r.add_argument("--jobs", "-j", type=positive, default=None, metavar="N",
                   help="worker processes (default: $QMOE_RTC_JOBS, else the number of CPUs)")
    r.add_argument("--cache-dir", metavar="DIR", help="cache directory (default: $QMOE_RTC_CACHE_DIR, else ~/.cache/qmoe_rtc)")
    r.add_argument("--list", action="store_true", help="print the plan (modules per arch) and exit; compiles nothing")
    r.add_argument("--dry-run", action="store_true", help="the same as --list")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _configs(args) -> list:
    """Every ModelConfig the arguments describe (each once)."""
    from ..errors import QMoEAttributeError
    from ..formats.axis import weight_format
    from ..specialize.presets import Preset, get_preset

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
    formats = [weight_format(f, "--format") for f in args.format]  # WeightFormatError names the format names
    out = {}
    for dtype in args.dtype:
        router = None if args.router_gemm is None else dtype if args.router_gemm else ""
        for fmt in formats:
            fixed = fmt.name != "int"  # a float format fixes bits and zero points (an FP4 one also the block)
            for bits in ([None] if fixed else args.bits or [None]):
                for bs in ([None] if fmt.scale.block else args.block_size or [None]):
                    for zp in (["none"] if fixed else args.zero_points):
                        cfg = base.config(bits=bits, fc1_bits=args.fc1_bits, fc2_bits=args.fc2_bits,
                                          fc3_bits=args.fc3_bits, block_size=bs, zero_points=zp, dtype=dtype,
                                          scale_dtype=args.scale_dtype,
                                          activation=args.activation if args.preset else None,
                                          swiglu_fusion=args.swiglu_fusion if args.preset else None,
                                          has_fc3=args.fc3 if args.preset else None, format=fmt.name,
                                          shared=args.shared, shared_gate=args.shared_gate, router_gemm=router,
                                          scoring_func=args.scoring_func, n_group=args.n_group,
                                          expert_counts=args.expert_counts)
                        out.setdefault(cfg, None)
    return list(out)


def _ext_words(cfg) -> str:
    """' shared 1 (gated), router GEMM bfloat16' for a config with [ext] parts, else ''."""
    words = [f"shared {cfg.shared}" + (" (gated)" if cfg.shared_gate else "")] if cfg.shared else []
    words += [f"router GEMM {cfg.router_gemm}"] if cfg.router_gemm else []
    words += [f"sigmoid routing ({cfg.n_group} groups)" if cfg.n_group > 1 else "sigmoid routing"] \
        if cfg.scoring_func == "sigmoid" else []
    words += ["expert counts"] if cfg.expert_counts else []
    return (" " + ", ".join(words)) if words else ""


def plan(configs, archs: Sequence[str], variants=("decode", "prefill")) -> list[tuple]:
    """Unique (spec, arch) pairs to build, in a stable order."""
    from ..kernels import modules_for
    from ..runtime.layer import executor_config

    seen: dict = {}
    for arch in archs:
        for cfg in configs:
            # the codes tiled where the executor's prepack would tile them (the QMOE_RTC_PREPACK knob's choice)
            for spec in modules_for(executor_config(cfg), variants, arch):  # the arch settles device-dependent engines
                seen.setdefault((spec, arch), None)
    return list(seen)


def _build(spec, arch):
    """Worker: fetch or compile one module (its pieces side by side), on disk when done. Returns (origin:
    'compiled' / 'stored' when any piece was, ms, cubin bytes)."""
    from ..jit import store_cubins
    from ..kernels import spec_unit

    t0 = time.perf_counter()
    mods = store_cubins(spec_unit(spec), arch)
    origins = {m.origin for m in mods}
    origin = next((o for o in ("compiled", "stored") if o in origins), mods[0].origin)
    return origin, (time.perf_counter() - t0) * 1e3, sum(len(m.cubin) for m in mods)


def _die_with_parent(parent: int) -> None:
    """Make this worker process end when the warm process does, however it ends (``kill -9`` included):
    PR_SET_PDEATHSIG on Linux, and everywhere a thread that watches for the parent to go."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # no prctl: the watcher below still does it
            pass
    if os.getppid() != parent:  # the parent died before the death signal was armed
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.25)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="qmoe_rtc-warm-parent-watch", daemon=True).start()


def _worker_init(parent: int, values: dict) -> None:
    """Worker-process initializer: die with the parent, then take its knob values."""
    from ..settings import knobs

    _die_with_parent(parent)
    knobs.apply(values)


def _progress(done: int, total: int, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _archs(args) -> list[str]:
    """The --arch values, else this machine's GPU; without one, a one-line hint to pass --arch sm_XX."""
    from ..errors import DeviceError
    from ..jit import check_arch, default_arch
    from ..jit.compiler import ARCH_HINT
    from ..jit.driver import probe

    if args.arch:
        return [check_arch(a) for a in args.arch]
    try:
        return [default_arch()]
    except DeviceError as exc:
        try:
            probe()
            reason = str(exc).replace("; " + ARCH_HINT, "")  # the library's arch='...' hint is not for the CLI
        except DeviceError as why:  # the probe's words, without its "running layers needs ..." tail
            reason = str(why).split("; running layers needs")[0]
        raise DeviceError(f"no --arch given and no GPU to take it from ({reason}); pass --arch sm_XX, e.g. "
                          "--arch sm_90 (H100/H200) or --arch sm_80 (A100), repeatable") from None


def _check_location(archs) -> None:
    """:class:`CacheLocationError` unless every arch's cache directory can store entries (warm's job)."""
    from ..errors import CacheLocationError
    from ..jit import store
    from ..settings import knobs

    if knobs.get("no_disk_cache"):
        raise CacheLocationError("QMOE_RTC_NO_DISK_CACHE is set: warm stores into the disk cache; unset it")
    for arch in archs:
        store.location(arch, write=True, strict=True)


def _run(todo, jobs: int, report) -> None:
    """Build every (spec, arch) of ``todo``; ``report(spec, arch, result or exception)`` per module."""
    from ..settings import knobs

    if jobs == 1:
        for spec, arch in todo:
            try:
                res = _build(spec, arch)
            except Exception as exc:  # reported per module, the exit code says it
                res = exc
            report(spec, arch, res)
        return
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init,
                                  initargs=(os.getpid(), knobs.snapshot()))
    try:
        futs = {pool.submit(_build, spec, arch): (spec, arch) for spec, arch in todo}
        for fut in cf.as_completed(futs):
            spec, arch = futs[fut]
            try:
                res = fut.result()
            except Exception as exc:
                res = exc
            report(spec, arch, res)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The warm command; returns the exit status (see the module docstring)."""
    from ..errors import QMoEError
    from ..settings import knobs

    args = build_parser().parse_args(argv)
    overrides = {"cache_dir": args.cache_dir} if args.cache_dir else {}
    try:
        with knobs.scope(**overrides):
            return _main(args)
    except QMoEError as exc:  # bad knob values, bad arguments, no GPU to take the arch from: one line
        print(f"qmoe_rtc warm: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2


def _main(args) -> int:
    from ..errors import CacheError
    from ..jit import check_stored, disk_entry_dir, store
    from ..kernels import spec_unit
    from ..settings import knobs

    knobs.snapshot()  # every knob parsed now, so a bad value is refused before any work
    archs = _archs(args)
    configs = _configs(args)
    todo = plan(configs, archs, tuple(args.variants))
    if args.list or args.dry_run:
        for cfg in configs:
            print(f"# {cfg.name} H{cfg.hidden} I{cfg.inter} E{cfg.experts} k{cfg.k}{_ext_words(cfg)}: {cfg.layout.name}")
        for spec, arch in todo:
            print(f"{arch} {spec.name}")
        print(f"{len(todo)} modules, {len(archs)} arch(s), cache {knobs.cache_dir()} ({knobs.cache_mode()})")
        return 0
    try:
        _check_location(archs)
    except CacheError as exc:
        print(f"qmoe_rtc warm: cannot store kernels: {exc}", file=sys.stderr)
        return 2

    jobs = max(1, min(args.jobs or knobs.get("jobs") or os.cpu_count() or 1, len(todo)))
    show = not args.no_progress and sys.stderr.isatty()
    t0 = time.perf_counter()
    counts = {"stored": 0, "hit": 0}
    failures = []

    def report(spec, arch, res):
        if not isinstance(res, BaseException):
            try:  # on disk, intact, what a later process will load
                check_stored(spec_unit(spec), arch)
            except CacheError as exc:
                res = CacheError(f"not stored: {exc}")
        if isinstance(res, BaseException):
            failures.append((spec, arch, res))
            line = str(res).splitlines()[0] if str(res) else ""
            print(f"{arch} {spec.name} FAILED {type(res).__name__}: {line}", flush=True)
        else:
            origin, ms, size = res
            status = "stored" if origin in ("compiled", "stored") else "hit"
            counts[status] += 1
            print(f"{arch} {spec.name} {status} {ms:.1f} ms ({size} B)", flush=True)
        _progress(counts["stored"] + counts["hit"] + len(failures), len(todo), show)

    _run(todo, jobs, report)
    for arch in archs:  # what killed runs left (temp files, lock files): their stems' locks are free
        store.sweep(disk_entry_dir(arch))
    wall = time.perf_counter() - t0
    print(f"warmed {len(todo)} modules for {','.join(archs)}: {counts['stored']} stored, {counts['hit']} hits, "
          f"{len(failures)} failed in {wall:.2f} s ({jobs} workers); cache {knobs.cache_dir()}")
    for spec, arch, exc in failures:
        print(f"--- {arch} {spec.name}: {exc}", file=sys.stderr)
        numbered = getattr(exc, "numbered_source", None)
        if callable(numbered):
            print(numbered(), file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
