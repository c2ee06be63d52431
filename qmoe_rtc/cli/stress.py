"""Contention stress check: ``python -m qmoe_rtc stress``.

N worker processes share one GPU (optionally beside ``--hog`` processes that keep it busy with large
matrix products), each with its own seed, drawing layers from :data:`LAYOUTS` on every engine they can
run and checking, per forward, that a graph replay equals an eager call bitwise and that both match
the float64 reference, with outputs, scratch and shared memory poisoned (:mod:`qmoe_rtc.cli.stress_gpu`).
Every module the cases load is compiled first, in parallel, so the workers start together.

Prints one row per engine (layer-runs, replay / eager differences, reference failures, worst error)
and exits 0 only when every engine ran and none differed, 1 otherwise, 2 on a usage error.

    python -m qmoe_rtc stress --procs 16 --seconds 120
    python -m qmoe_rtc stress --layouts bf16-b8-row-silu --engines prefill-mma,prefill-wgmma --rows 64,1000
    python -m qmoe_rtc stress --layouts bf16-b8-row-silu-norm --rows 1000   # the contention race's exact layer and run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

from .args import csv, names, positive

__all__ = ["ENGINES", "RACE_LAYOUT", "LAYOUTS", "aggregate", "build_parser", "cases", "main", "rows_for"]

#: (name, random_layer kwargs with k, E, H, I, activation dtype). The first is the layer of the race
#: found under contention (graph replays that differed from eager calls); :data:`RACE_LAYOUT`, the second, is that
#: report's exact layer
#: (routing weights normalised too: ``--layouts bf16-b8-row-silu-norm --rows 1000`` reproduces its run,
#: 1000 rows of bf16 H 256, I 128, E 16, k 2, int8 row-wise symmetric, silu); together they cover bits
#: 1/2/3/4/8, FP8 and FP4, row-wise and block scales, zero points, GLU and plain activations, FC3, biases,
#: float16 / bfloat16 / float32, shared experts with a gate and the router GEMM, and H / I that are not
#: multiples of 32 (SIMT engines); the last, FC2's K long enough to run in parts on the wgmma engine (16 chunks of 128).
LAYOUTS = (
    ("bf16-b8-row-silu", dict(bits=8, block_size=0, activation_type="silu", k=2), 16, 256, 128, "bfloat16"),
    ("bf16-b8-row-silu-norm", dict(bits=8, block_size=0, activation_type="silu", k=2, normalize_routing_weights=1), 16,
     256, 128, "bfloat16"),
    ("f16-b4-bs128-swiglu", dict(bits=4, block_size=128, activation_type="swiglu", k=2), 16, 256, 128, "float16"),
    ("bf16-b4-bs32-zp-swiglu2-k4", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu",
                                        swiglu_fusion=2, k=4), 16, 256, 128, "bfloat16"),
    ("f16-b2-bs64-gelu", dict(bits=2, block_size=64, activation_type="gelu", k=2), 16, 256, 128, "float16"),
    ("f16-b1-bs32-relu", dict(bits=1, block_size=32, activation_type="relu", k=2), 8, 256, 128, "float16"),
    ("bf16-b3-row-zp-geglu", dict(bits=3, block_size=0, zero_points=True, activation_type="geglu", k=2), 16, 256, 128,
     "bfloat16"),
    ("f16-b8-bs64-zp-silu-fc3-bias", dict(bits=8, block_size=64, zero_points=True, activation_type="silu", fc3=True,
                                          bias=True, k=2), 8, 256, 128, "float16"),
    ("bf16-mixed-4-8-row-gelu", dict(bits=(4, 8, 4), block_size=0, activation_type="gelu", k=2), 16, 256, 128,
     "bfloat16"),
    ("bf16-fp8-global-swiglu", dict(format="fp8_e4m3", block_size=0, activation_type="swiglu", k=2), 16, 256, 128,
     "bfloat16"),
    ("f16-fp8-bs128-silu", dict(format="fp8_e4m3", block_size=128, activation_type="silu", k=2), 8, 256, 128,
     "float16"),
    ("bf16-b4-bs128-shared-router", dict(bits=4, block_size=128, activation_type="swiglu", k=2, shared=1,
                                         shared_gate=True, router_gemm=True), 16, 256, 128, "bfloat16"),
    ("f32-b4-bs32-zp-swiglu", dict(bits=4, block_size=32, zero_points=True, activation_type="swiglu", k=2), 16, 256,
     128, "float32"),
    ("f32-b3-row-relu", dict(bits=3, block_size=0, activation_type="relu", k=2), 8, 256, 128, "float32"),
    ("f16-b4-offset-silu", dict(bits=4, block_size=0, zero_point_offset=7.5, activation_type="silu", k=2), 16, 256,
     128, "float16"),
    ("bf16-b8-row-silu-oddK", dict(bits=8, block_size=0, activation_type="silu", k=2), 16, 200, 72, "bfloat16"),
    ("bf16-mxfp4-swiglu-bias", dict(format="mxfp4", block_size=32, activation_type="swiglu", k=2, bias=True,
                                    activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0), 16, 256, 128,
     "bfloat16"),
    ("f16-nvfp4-swiglu2", dict(format="nvfp4", block_size=16, activation_type="swiglu", swiglu_fusion=2, k=2), 8,
     256, 128, "float16"),
    ("bf16-b4-bs128-swiglu-longK", dict(bits=4, block_size=128, activation_type="swiglu", k=2), 8, 128, 2048,
     "bfloat16"),
)

#: The name of the contention race's exact layer in :data:`LAYOUTS` (its replay / eager difference: 2 of 256000 outputs
#: at 1000 rows, 16 processes on one GPU, prefill-wgmma and prefill-mma).
RACE_LAYOUT = "bf16-b8-row-silu-norm"

#: Engines (pipelines) and how a case forces one: the path through decode_max_routes, the prefill engine
#: through the tuning knob prefill_engine. Tensor-core layouts run the first four, the others the SIMT two.
TENSOR_CORE_ENGINES = ("decode-mma", "prefill-batched", "prefill-mma", "prefill-wgmma")
SIMT_ENGINES = ("decode-gemv", "prefill-simt")
ENGINES = TENSOR_CORE_ENGINES + SIMT_ENGINES

#: Row counts drawn per path (decode: up to 512 routes; prefill: 1 ... 4096).
DECODE_ROWS = (1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 128)
PREFILL_ROWS = (1, 3, 16, 64, 200, 1000, 2048, 4096)


def model_config(layout):
    """The :class:`~qmoe_rtc.specialize.ModelConfig` of a layout (GPU-free: a small layer drawn on the CPU)."""
    import numpy as np

    from ..contract.checks import QMoEAttributes
    from ..contract.random_layer import random_layer
    from ..runtime.layer import describe_gpu_layer, layer_config
    from ..runtime.tensors import layer_scale_dtype

    name, kw, E, H, I, dtype = layout
    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(np.random.default_rng(0), E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    g = describe_gpu_layer(w, QMoEAttributes.from_kwargs(**a), {})
    return layer_config(g.layer, dtype, layer_scale_dtype(g.layer), g.ext)


def _tensor_core(layout) -> bool:
    """Whether the tensor-core engines run the layout (their own rule, kernels/_expert.py)."""
    from ..kernels._expert import tensor_core_unsupported

    return tensor_core_unsupported(model_config(layout)) is None


def cases(layouts: Sequence[str] | None = None, engines: Sequence[str] | None = None, wgmma: bool = True) -> list:
    """(layout, engine) pairs to run: every engine each layout can run (wgmma only when the GPU has it),
    filtered by name."""
    out = []
    for lay in LAYOUTS:
        if layouts and lay[0] not in layouts:
            continue
        for eng in TENSOR_CORE_ENGINES if _tensor_core(lay) else SIMT_ENGINES:
            if (engines and eng not in engines) or (eng.startswith("prefill-wgmma") and not wgmma):
                continue
            out.append((lay, eng))
    return out


def rows_for(case, rows: Sequence[int] | None = None) -> list[int]:
    """Row counts a case draws from: ``rows`` (the --rows option) or its path's list; decode keeps rows·k ≤ 512."""
    (name, kw, E, H, I, dtype), engine = case
    slots = kw["k"] + int(kw.get("shared", 0))
    pool = rows or (DECODE_ROWS if engine.startswith("decode") else PREFILL_ROWS)
    return [r for r in pool if not engine.startswith("decode") or r * slots <= 512] or [1]


def aggregate(lines: Sequence[str]) -> dict:
    """Totals per engine over the workers' JSON lines, and the failure / error records."""
    engines: dict = {}
    failures, errors, workers = [], [], 0
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        ev = rec.get("event")
        if ev == "summary":
            workers += 1
            for eng, s in rec["engines"].items():
                t = engines.setdefault(eng, {"runs": 0, "diff": 0, "ref_fail": 0, "worst": 0.0})
                for f in ("runs", "diff", "ref_fail"):
                    t[f] += s[f]
                t["worst"] = max(t["worst"], s["worst"])
        elif ev == "failure":
            failures.append(rec)
        elif ev == "error":
            errors.append(rec)
    return dict(engines=engines, failures=failures, errors=errors, workers=workers)


def table(result: dict, want: Sequence[str], min_runs: int) -> tuple[str, bool]:
    """The per-engine table and whether the check passed (every wanted engine with ≥ min_runs runs, no
    difference, no reference failure, no error)."""
    lines = [f"{'engine':<15}{'layer-runs':>11}{'replay!=eager':>15}{'ref fails':>11}{'worst rel err':>15}"]
    ok = not result["errors"]
    for eng in sorted(set(want) | set(result["engines"])):
        s = result["engines"].get(eng, {"runs": 0, "diff": 0, "ref_fail": 0, "worst": 0.0})
        short = eng in want and s["runs"] < min_runs
        ok = ok and not short and s["diff"] == 0 and s["ref_fail"] == 0
        lines.append(f"{eng:<15}{s['runs']:>11}{s['diff']:>15}{s['ref_fail']:>11}{s['worst']:>15.2e}"
                     + ("  (fewer than --min-runs)" if short else ""))
    lines.append(f"workers {result['workers']}, errors {len(result['errors'])}: {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines), ok


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc stress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=positive, default=16, help="worker processes on the GPU at once (default 16)")
    p.add_argument("--hog", type=int, default=0, help="extra processes that keep the GPU busy with matrix products")
    p.add_argument("--seconds", type=float, default=60.0, help="how long the workers run (default 60)")
    p.add_argument("--layouts", type=names([lay[0] for lay in LAYOUTS], "layout"), help="layout names (default: all)")
    p.add_argument("--engines", type=names(ENGINES, "engine"), help="engines (default: all this GPU has)")
    p.add_argument("--rows", type=csv(int), help="row counts to draw from (default: per path, 1..4096)")
    p.add_argument("--rows-per-layer", type=positive, default=2, help="row counts checked per random layer")
    p.add_argument("--inputs", type=positive, default=2, help="fresh inputs written per captured graph (default 2)")
    p.add_argument("--min-runs", type=int, default=1, help="layer-runs every engine must reach to pass")
    p.add_argument("--seed", type=int, default=0, help="worker i uses seed + i")
    p.add_argument("--no-smem-poison", dest="poison_smem", action="store_false",
                   help="do not fill shared memory with garbage before each forward")
    p.add_argument("--diagnose", action="store_true", help="on a difference, say which scratch buffers differ")
    p.add_argument("--torch", action="store_true",
                   help="torch CUDA tensors, the graph recorded by torch.cuda.graph around the layer call")
    p.add_argument("--fresh", type=int, default=0, metavar="N",
                   help="each worker process checks N layers and exits, a new one starting in its place (the "
                        "first forwards of a process, module loads and first plans included, under contention)")
    p.add_argument("--json", help="write the totals and every failure record here")
    p.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="do not compile the modules first: the workers compile (and race for the cache) themselves")
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # internal: run as worker i
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)  # internal: layers a worker checks
    p.add_argument("--hog-worker", action="store_true", help=argparse.SUPPRESS)
    return p


def _hog(seconds: float) -> int:
    import cupy as cp

    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32)
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        for _ in range(4):
            a = a @ a
            a /= cp.linalg.norm(a)
        cp.cuda.get_current_stream().synchronize()
    return 0


def modules(selected: list, arch: str) -> list:
    """(module spec, arch) pairs of every module the cases can load on ``arch`` (GPU-free)."""
    from .warm import plan

    layouts = {lay[0]: lay for lay, _ in selected}
    return plan([model_config(lay) for lay in layouts.values()], [arch])


def _precompile(selected: list) -> None:
    """Compile every module the cases can load, in parallel, before the workers start."""
    from ..jit import default_arch
    from .warm import _run

    arch = default_arch()
    todo = modules(selected, arch)
    failed = []
    t0 = time.perf_counter()
    _run(todo, os.cpu_count() or 1, lambda spec, arch, res: failed.append(spec.name) if isinstance(res, Exception)
         else None)
    print(f"stress: {len(todo)} modules ready for {arch} in {time.perf_counter() - t0:.1f} s"
          + (f", FAILED: {failed}" if failed else ""), flush=True)


def worker_argv(args) -> list[str]:
    """The options a worker process gets: the parent's, less its own outputs and the hogs."""
    out = ["--procs", str(args.procs), "--seconds", str(args.seconds), "--seed", str(args.seed),
           "--rows-per-layer", str(args.rows_per_layer), "--inputs", str(args.inputs)]
    for flag, value in (("--layouts", args.layouts), ("--engines", args.engines), ("--rows", args.rows)):
        if value:
            out += [flag, ",".join(map(str, value))]
    if not args.poison_smem:
        out.append("--no-smem-poison")
    for flag in ("diagnose", "torch"):
        if getattr(args, flag):
            out.append("--" + flag)
    return out


def _spawn(argv_extra: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qmoe_rtc", "stress", *argv_extra], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ))


def _run_workers(args) -> list[str]:
    """Run the workers (``--procs`` at once) and return their output lines. With ``--fresh N`` each
    worker checks N layers and exits, and a new one (the next seed) takes its place until ``--seconds``."""
    def collect(w) -> list[str]:
        out, _ = w.communicate()
        extra = [json.dumps(dict(event="error", error=f"worker exited {w.returncode}"))] if w.returncode else []
        return out.splitlines() + extra

    if not args.fresh:
        workers = [_spawn([*worker_argv(args), "--worker", str(i)]) for i in range(args.procs)]
        return [line for w in workers for line in collect(w)]
    lines: list[str] = []
    t_end, started = time.monotonic() + args.seconds, 0
    running: list = []
    while running or time.monotonic() < t_end:
        while time.monotonic() < t_end and len(running) < args.procs:
            running.append(_spawn([*worker_argv(args), "--worker", str(started), "--layers", str(args.fresh)]))
            started += 1
        time.sleep(0.05)
        for w in [w for w in running if w.poll() is not None]:
            running.remove(w)
            lines += collect(w)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.hog_worker:
        return _hog(args.seconds)
    from ..jit.driver import probe

    probe(0)  # no driver, driver too old, no GPU: one line (a DeviceError) before CuPy is asked
    from ..jit import default_arch
    from ..kernels.arch import ArchSpec

    wgmma = ArchSpec(default_arch()).warpgroup_mma
    selected = cases(args.layouts, args.engines, wgmma)
    if not selected:
        print("stress: no case matches --layouts / --engines on this GPU", file=sys.stderr)
        return 2
    if args.worker is not None:
        from .stress_gpu import run_worker

        args.cases = selected
        args.rows_of = {(case[0][0], case[1]): rows_for(case, args.rows) for case in selected}
        args.index, args.seed = args.worker, args.seed + args.worker
        return run_worker(args)
    if args.precompile:
        _precompile(selected)
    hogs = [_spawn(["--hog-worker", "--seconds", str(args.seconds + 30)]) for _ in range(args.hog)]
    fresh = f" (a new one every {args.fresh} layers)" if args.fresh else ""
    hogging = f" beside {args.hog} hogs" if args.hog else ""
    print(f"stress: {args.procs} worker processes{fresh}{hogging} for {args.seconds:.0f} s over {len(selected)} cases "
          f"({', '.join(sorted({eng for _, eng in selected}))}); the table follows", flush=True)
    lines = _run_workers(args)
    for h in hogs:
        h.kill()
        h.wait()
    result = aggregate(lines)
    want = sorted({eng for _, eng in selected})
    text, ok = table(result, want, args.min_runs)
    for rec in result["failures"][:20]:
        print("FAILURE " + json.dumps(rec))
    for rec in result["errors"][:20]:
        print("ERROR " + json.dumps(rec))
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list, type(None)))},
                           **result, passed=ok), f, indent=1)
    return 0 if ok else 1
