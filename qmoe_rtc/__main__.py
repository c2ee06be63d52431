"""Command line: ``python -m qmoe_rtc {info,demo,warm,bench,stress,checkpoint}``."""

from __future__ import annotations

import argparse
import platform
import sys
import time

from .cli.args import positive


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args) -> int:
    """Versions, NVRTC found?, GPU found? (``--engines``: the engine table instead, from the pipelines.)"""
    import qmoe_rtc

    if getattr(args, "engines", False):
        from .kernels.pipelines import engine_table

        print(engine_table(), end="")
        return 0

    print(f"qmoe_rtc            {qmoe_rtc.__version__}")
    print(f"python              {platform.python_version()} ({sys.executable})")
    for dist in ("numpy", "ml_dtypes", "cupy-cuda13x", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
                 "onnxruntime"):
        print(f"{dist:<20}{_version(dist)}")
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        print(f"NVRTC               {major}.{minor}" if int(err) == 0 else f"NVRTC               error {err}")
    except Exception as exc:  # report, don't fail: info is a diagnostic
        print(f"NVRTC               not found ({type(exc).__name__}: {exc})")
    for line in _gpu_lines():
        print(line)
    try:
        from .settings import knobs

        print(f"kernel cache        {knobs.cache_dir()} (mode: {knobs.cache_mode()})")
    except Exception as exc:  # knobs may be mis-set; say so
        print(f"kernel cache        unavailable ({exc})")
    print(f"knobs               {_knob_line()}")
    return 0


def _knob_line() -> str:
    """The knobs set in the environment (QMOE_RTC_* variables, QMOE_RTC_TUNE's items), or the first one with a value
    it does not take (``info`` is a diagnostic: it says so instead of refusing, as the other commands do)."""
    from .errors import KnobError
    from .settings import knobs

    try:
        knobs.snapshot()
    except KnobError as exc:
        return f"BAD: {exc}"
    given = [f"{name}={value}" for name, value in knobs.given().items()]
    return ", ".join(given) if given else "none set (the defaults)"


def _gpu_lines() -> list[str]:
    """The driver and GPU lines of ``info``: what :func:`qmoe_rtc.jit.driver.probe` finds, in the words a
    layer would raise (no driver, driver too old, no GPU), then each GPU."""
    from .errors import DeviceError
    from .jit.driver import probe

    try:
        version, count = probe()
    except DeviceError as exc:
        return [f"GPU                 none usable: {exc}"]
    lines = [f"CUDA driver         {version // 1000}.{version % 1000 // 10}"]
    try:
        import cupy

        for i in range(count):
            p = cupy.cuda.runtime.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
            lines.append(f"{f'GPU {i}':<20}{name}, sm_{p['major']}{p['minor']}, {p['multiProcessorCount']} SMs, "
                         f"{p['totalGlobalMem'] / 2**30:.0f} GiB" + _overlap_note(p["major"] * 10 + p["minor"]))
    except Exception as exc:  # CuPy disagreeing with the driver probe: say so, info is a diagnostic
        lines.append(f"GPU                 the driver sees {count}, CuPy cannot read them "
                     f"({type(exc).__name__}: {str(exc).splitlines()[0]})")
    return lines


def _overlap_note(cc: int) -> str:
    """', overlapped launches on|off' for a device of compute capability ``cc`` (major·10 + minor): whether
    the decode kernels start while their predecessor finishes (programmatic dependent launch)."""
    try:
        from .runtime.plan import overlap_allowed

        on = overlap_allowed(f"sm_{cc}")
    except Exception as exc:  # a mis-set knob: say so, info is a diagnostic
        return f", overlapped launches unknown ({exc})"
    from .kernels.arch import ArchSpec

    return f", overlapped launches {'on' if on else 'off'}" + ("" if ArchSpec(f"sm_{cc}").pdl else " (sm_90+ only)")


def _gpu_present() -> bool:
    from .errors import DeviceError
    from .jit.driver import probe

    try:
        return probe()[1] > 0
    except DeviceError:
        return False


def _progress_line():
    """``progress(projection, done, total)`` writing one updating line to stderr (when stderr is not a
    terminal: a line at every quarter)."""
    tty = sys.stderr.isatty()
    last: dict[str, int] = {}

    def progress(name: str, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        text = f"  quantizing {name}: {done}/{total} experts ({pct} %)"
        if tty:
            sys.stderr.write("\r" + text + ("\n" if done == total else ""))
        elif pct // 25 > last.get(name, -1):
            last[name] = pct // 25
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    return progress


def cmd_demo(args) -> int:
    """A random Qwen3-30B-A3B-shaped layer (int4, block 128): reference on the CPU, GPU when present."""
    import numpy as np

    from .contract.random_layer import random_inputs, random_layer
    from .contract.reference import qmoe

    rng = np.random.default_rng(args.seed)
    H, I, E, k = 2048, 768, 128, 8
    print(f"demo: qwen3-30b-a3b-shaped layer H={H} I={I} E={E} k={k}, int4 block 128, swiglu, {args.dtype}, "
          f"{args.tokens} token(s)")
    t = time.perf_counter()
    weights, attrs = random_layer(rng, E=E, H=H, I=I, k=k, bits=4, block_size=128, dtype=args.dtype,
                                  activation_type="swiglu", normalize_routing_weights=1, progress=_progress_line())
    x, logits, _ = random_inputs(rng, args.tokens, H, E, args.dtype)
    print(f"  built and quantized the layer in {time.perf_counter() - t:.2f} s")
    t = time.perf_counter()
    ref = qmoe(x, logits, **weights, **attrs)
    print(f"  CPU float64 reference: {1e3 * (time.perf_counter() - t):.1f} ms")
    if not _gpu_present():
        print("  GPU: none found, GPU path skipped")
        return 0
    try:
        from .executor import QMoE
    except ImportError as exc:
        print(f"  GPU: present, but this build has no GPU executor ({exc})")
        return 0
    import cupy as cp

    moe = QMoE(**{n: cp.asarray(v) for n, v in weights.items()}, **attrs)
    xd, ld = cp.asarray(x), cp.asarray(logits)
    t = time.perf_counter()
    y = moe(xd, ld)
    cp.cuda.get_current_stream().synchronize()
    first = time.perf_counter() - t
    for _ in range(3):
        moe(xd, ld)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    n = 20
    for _ in range(n):
        y = moe(xd, ld)
    end.record()
    end.synchronize()
    per = cp.cuda.get_elapsed_time(start, end) / n
    out = cp.asnumpy(y).astype(np.float64)
    r = ref.astype(np.float64)
    err = np.linalg.norm(out - r) / np.linalg.norm(r)
    print(f"  GPU: first call (incl. compile/load) {first * 1e3:.1f} ms, eager {per * 1e3:.1f} us/call, "
          f"relative error vs reference {err:.2e}")
    from .bench.report import TOL

    return 0 if err < TOL[args.dtype] else 1


def shadowed_trees(pythonpath: str, imported: str) -> list[str]:
    """The ``PYTHONPATH`` entries holding a ``qmoe_rtc`` package other than the one ``imported`` (its
    directory): ``python -m`` puts the working directory ahead of them, so a tree named there does not run
    when a ``qmoe_rtc`` sits in the working directory (a tree A/B would time one tree twice)."""
    import os

    here = os.path.realpath(imported)
    out = []
    for entry in filter(None, pythonpath.split(os.pathsep)):
        pkg = os.path.join(entry, "qmoe_rtc")
        if os.path.isfile(os.path.join(pkg, "__init__.py")) and os.path.realpath(pkg) != here:
            out.append(pkg)
    return out


def main(argv=None) -> int:
    import os

    for pkg in shadowed_trees(os.environ.get("PYTHONPATH", ""), os.path.dirname(os.path.abspath(__file__))):
        print(f"qmoe_rtc: WARNING: running {os.path.dirname(os.path.abspath(__file__))}, not {pkg} that PYTHONPATH "
              "names (python -m puts the working directory first; run from that tree's directory)", file=sys.stderr)
    parser = argparse.ArgumentParser(prog="python -m qmoe_rtc", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("info", help="versions, NVRTC and GPU found?")
    i.add_argument("--engines", action="store_true",
                   help="print the engine table instead (the pipelines, fastest first: README's \"Which kernels run\")")
    d = sub.add_parser("demo", help="run a random Qwen3-30B-A3B-shaped layer")
    d.add_argument("--tokens", type=positive, default=4, help="tokens (rows) of the input (default: 4)")
    d.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float16",
                   help="activation dtype (default: float16)")
    d.add_argument("--seed", type=int, default=0, help="random seed of the layer and inputs (default: 0)")
    sub.add_parser("warm", help="pre-compile kernels into the on-disk cache (see `warm --help`)", add_help=False)
    sub.add_parser("bench", help="benchmarks: run, peers, ab, crossover, host, soak, stress, reference (see `bench --help`)",
                   add_help=False)
    sub.add_parser("stress", help="contention stress check on the GPU (see `stress --help`)", add_help=False)
    sub.add_parser("checkpoint", help="read a GPTQ / AWQ / compressed-tensors checkpoint's MoE layers "
                   "(see `checkpoint --help`)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    from .errors import QMoEError

    try:
        if argv and argv[0] != "info" and not {"-h", "--help"} & set(argv):
            from .settings import knobs

            knobs.snapshot()  # every QMOE_RTC_* variable read once: a bad one is refused before any work
        if argv and argv[0] == "warm":
            from .cli.warm import main as warm_main

            return warm_main(argv[1:])
        if argv and argv[0] == "bench":
            from .bench.cli import main as bench_main

            return bench_main(argv[1:])
        if argv and argv[0] == "stress":
            from .cli.stress import main as stress_main

            return stress_main(argv[1:])
        if argv and argv[0] == "checkpoint":
            from .checkpoints.cli import main as checkpoint_main

            return checkpoint_main(argv[1:])
        args = parser.parse_args(argv)
        return {"info": cmd_info, "demo": cmd_demo}[args.cmd](args)
    except QMoEError as exc:  # a bad QMOE_RTC_* value, no usable GPU ...: one line, no traceback
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"qmoe_rtc {argv[0] if argv else ''}: {type(exc).__name__}: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
