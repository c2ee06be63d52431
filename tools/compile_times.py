"""Cold NVRTC compile time of every module a preset's layer loads (one process, a fresh cache, one
module at a time, a module's parts side by side as the executor builds them; the first compile also pays
NVRTC's start-up). No GPU needed.

Cold means below our cache too: NVRTC 13 keeps its own cache of compilations (``~/.nv/ComputeCache``,
the driver's JIT cache), so a module compiled before on the machine, in any process and under any of our
cache directories, comes back in ~0.1 s. This tool runs with ``CUDA_CACHE_DISABLE=1`` (it restarts
itself with it set; ``--nvrtc-cache`` keeps NVRTC's cache). Each line says where the module came from
(``compiled``; ``disk`` / ``memory`` would be our cache).

    python tools/compile_times.py --preset qwen3-30b-a3b --dtype bfloat16 --arch sm_90
    python tools/compile_times.py --preset gpt-oss-120b --rows 512   # what a first call at 512 tokens compiles

``--rows N`` times what the executor compiles for a first call at N tokens instead: the pieces holding the
kernels its plan launches (one route tile's GEMMs, plus routing and the grouping / combine piece), side by
side. The plan is worked out as the executor would on a device of ``--sms`` multiprocessors, with codes
tiled (``--contract-layout``: as given).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main(argv=None) -> int:
    from qmoe_rtc.jit import get_cubins
    from qmoe_rtc.kernels import modules_for, spec_unit
    from qmoe_rtc.settings import knobs
    from qmoe_rtc.specialize.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--modules", default="",
                   help="comma-separated module name prefixes to time (route, wgmma_prefill, ...); default: every one")
    p.add_argument("--nvrtc-cache", action="store_true",
                   help="leave NVRTC's own cache on (a module compiled before on this machine returns in ~0.1 s)")
    p.add_argument("--rows", type=int, default=0, help="time a first call's compile at ROWS tokens (see above)")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors of the device the plan is for (--rows)")
    p.add_argument("--contract-layout", action="store_true", help="codes as given, not tiled (--rows)")
    a = p.parse_args(argv)
    if a.rows < 0 or a.sms < 1:
        p.error(f"--rows must be 0 or more and --sms positive (got {a.rows}, {a.sms})")
    if not a.nvrtc_cache and os.environ.get("CUDA_CACHE_DISABLE") != "1":
        # in the environment from the process's start, as measured (session 23), however NVRTC reads it
        os.environ["CUDA_CACHE_DISABLE"] = "1"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)])
    only = {m for m in a.modules.split(",") if m}
    cfg = PRESETS[a.preset].config(dtype=a.dtype)
    if a.rows:
        return first_call(cfg, a)
    with tempfile.TemporaryDirectory() as d, knobs.scope(cache_dir=d):
        for spec in modules_for(cfg, arch=a.arch):
            if only and not any(spec.name.startswith(m) for m in only):
                continue
            t0 = time.perf_counter()
            mods = get_cubins(spec_unit(spec), a.arch)
            ms = 1e3 * (time.perf_counter() - t0)
            origin = "/".join(sorted({m.origin for m in mods}))
            print(f"{mods[0].arch} {spec.name} {origin} {ms:.1f} ms ({sum(len(m.cubin) for m in mods)} B"
                  f"{f', {len(mods)} parts' if len(mods) > 1 else ''})", flush=True)
            if len(mods) > 1:
                print("    parts: " + ", ".join(f"{m.name.rsplit('.', 1)[-1]} {m.ms:.0f} ms" for m in mods), flush=True)
    return 0


def first_call(cfg, a) -> int:
    """Compile, cold and side by side, the pieces a first call at ``a.rows`` tokens loads; print each and the wall time."""
    import concurrent.futures as cf
    import dataclasses

    from qmoe_rtc.jit import check_arch, get_cubin
    from qmoe_rtc.kernels import Problem, choose, decode_limit, get_family, spec_unit
    from qmoe_rtc.runtime.plan import launched
    from qmoe_rtc.settings import knobs

    if not a.contract_layout:
        cfg = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, tiled=True))
    arch = check_arch(a.arch)
    problem = Problem(rows=a.rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype,
                      arch=arch, shared=cfg.shared, shared_gate=cfg.shared_gate, router_gemm=cfg.router_gemm,
                      all_experts=cfg.all_experts, sms=a.sms)
    choice = choose(cfg, problem, "decode" if a.rows * cfg.k <= decode_limit(cfg) else "prefill")
    specs = {f: get_family(f).spec(cfg) for f in choice.pipeline.families}
    pieces = [piece for spec, keys in launched(choice.pipeline, specs, cfg, problem).items()
              for piece in spec_unit(spec).pieces() if keys & {k.key for k in piece.kernels}]
    with tempfile.TemporaryDirectory() as d, knobs.scope(cache_dir=d):
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(max_workers=min(len(pieces), os.cpu_count() or 1)) as pool:  # as load_modules does
            mods = list(pool.map(lambda piece: get_cubin(piece, arch), pieces))
        ms = 1e3 * (time.perf_counter() - t0)
    for piece, m in zip(pieces, mods):
        print(f"    {m.name} ({', '.join(k.key for k in piece.kernels)}) {m.origin} {m.ms:.0f} ms", flush=True)
    print(f"{arch} {a.preset} rows={a.rows} {choice.pipeline.name}: {len(pieces)} programs side by side in {ms:.0f} ms",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
