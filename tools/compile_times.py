"""Cold NVRTC compile time of every module a preset's layer loads (one process, a fresh cache, one
module at a time, a module's parts side by side as the executor builds them; the first compile also pays
NVRTC's start-up). No GPU needed.

Cold means below our cache too: NVRTC 13 keeps its own cache of compilations (``~/.nv/ComputeCache``,
the driver's JIT cache), so a module compiled before on the machine, in any process and under any of our
cache directories, comes back in ~0.1 s. This tool runs with ``CUDA_CACHE_DISABLE=1`` (it restarts
itself with it set; ``--nvrtc-cache`` keeps NVRTC's cache). Each line says where the module came from
(``compiled``; ``disk`` / ``memory`` would be our cache).

    python tools/compile_times.py --preset qwen3-30b-a3b --dtype bfloat16 --arch sm_90
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


def main(argv=None) -> int:
    from qmoe_rtc import knobs
    from qmoe_rtc.jit import get_cubins
    from qmoe_rtc.kernels import modules_for, spec_unit
    from qmoe_rtc.presets import PRESETS

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--modules", default="",
                   help="comma-separated module name prefixes to time (route, wgmma_prefill, ...); default: every one")
    p.add_argument("--nvrtc-cache", action="store_true",
                   help="leave NVRTC's own cache on (a module compiled before on this machine returns in ~0.1 s)")
    a = p.parse_args(argv)
    if not a.nvrtc_cache and os.environ.get("CUDA_CACHE_DISABLE") != "1":
        # in the environment from the process's start, as measured (session 23), however NVRTC reads it
        os.environ["CUDA_CACHE_DISABLE"] = "1"
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)])
    only = {m for m in a.modules.split(",") if m}
    cfg = PRESETS[a.preset].config(dtype=a.dtype)
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


if __name__ == "__main__":
    raise SystemExit(main())
