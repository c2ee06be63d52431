"""Where the one-block-per-tile wgmma prefill kernels spend a block's time (core/stamps.cuh), on the GPU.

Builds a bench shape's random int layer, compiles the engine with the tuning knob ``prefill_wg_stamps`` on, runs
one call to warm up and one measured call, and prints per kernel (FC1, FC2): blocks, chunks per tile, and
thread 0's cycles split into prologue (entry to main loop), main loop per chunk (waiting for copies and
the chunk barrier / the rest) and epilogue, then the kernel's span and how full the SMs were (the sum of
the tiles' durations over span × SMs). The stamps cost a few instructions per chunk; compare timings
with a build without them, not with this one.

  PYTHONPATH=. python tools/wg_stamps.py --preset mixtral-8x7b --tokens 4096 [--knob prefill_group=4]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def read_stamps(cp):
    """The stamps table of every loaded wgmma prefill module that has one (reads the JIT cache's loaded
    modules): {module name: (array [2 kernels, blocks, 8], device address, bytes)}."""
    from qmoe_rtc.jit import cache, driver

    drv = driver.bindings()
    out = {}
    for lm in list(cache._loaded.values()):
        if not lm.name.startswith("wgmma_prefill") or len(lm.modules) != 1:  # the stamped build is one program
            continue
        err, ptr, size = drv.cuModuleGetGlobal(lm.modules[0], b"qmoe_wg_stamps")
        if int(err) != 0:
            continue
        host = np.empty(int(size) // 8, np.int64)
        cp.cuda.runtime.memcpy(host.ctypes.data, int(ptr), int(size), cp.cuda.runtime.memcpyDeviceToHost)
        out[lm.name] = (host.reshape(2, -1, 8), int(ptr), int(size))
    return out


def summary(name: str, s: np.ndarray, sms: int) -> None:
    live = s[s[:, 4] > 0]
    if not len(live):
        return
    pro, loop, wait, epi, ch = (live[:, i].astype(np.float64) for i in range(5))
    dur = (live[:, 7] - live[:, 6]).astype(np.float64)
    span = float(live[:, 7].max() - live[:, 6].min())
    med = np.median
    print(f"{name}: {len(live)} blocks, {med(ch):.0f} chunks/tile, span {span / 1e3:.1f} us, "
          f"SMs busy {dur.sum() / (span * sms):.1%}")
    print(f"  cycles: prologue {med(pro):.0f}, loop {med(loop):.0f} ({med(loop / ch):.0f}/chunk: waiting "
          f"{med(wait / ch):.0f}, other {med((loop - wait) / ch):.0f}), epilogue {med(epi):.0f}; "
          f"tile {med(dur) / 1e3:.1f} us median, {dur.max() / 1e3:.1f} max")
    q = np.percentile(loop / ch, [10, 90])
    print(f"  loop cycles/chunk p10 {q[0]:.0f} p90 {q[1]:.0f}; prologue+epilogue share "
          f"{(pro + epi).sum() / (pro + loop + epi).sum():.1%}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--knob", action="append", default=[], help="NAME=VALUE (a qmoe_rtc knob, e.g. prefill_group=4)")
    args = p.parse_args(argv)
    import cupy as cp

    from qmoe_rtc.bench.layers import build_layer
    from qmoe_rtc.bench.report import BENCH_SHAPES
    from qmoe_rtc.contract.extensions import EXT_INPUTS
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.settings import knobs

    over = {"prefill_wg_stamps": True, "prefill_engine": "wgmma"}  # --knob prefill_engine=... for another engine
    for kv in args.knob:
        k, _, v = kv.partition("=")
        over[k] = knobs.KNOBS[k].parse(v)
    shape = BENCH_SHAPES[args.preset]
    rs = cp.random.default_rng(1)
    with knobs.scope(**over):
        weights, attrs = build_layer(cp, rs, shape, args.dtype, (args.bits, args.bits), shape.block_size, False)
        for n in [n for n in weights if n in EXT_INPUTS]:
            weights.pop(n)
        layer = QMoE(**weights, **attrs)
        x = rs.standard_normal((args.tokens, shape.H), dtype=cp.float32).astype(args.dtype)
        logits = 2 * rs.standard_normal((args.tokens, shape.E), dtype=cp.float32)
        layer(x, logits)
        cp.cuda.Device().synchronize()
        tables = read_stamps(cp)
        if not tables:
            print("no stamped wgmma prefill module ran (is this an sm_90 device and a prefill-sized call?)")
            return 1
        for _, ptr, size in tables.values():
            cp.cuda.runtime.memset(ptr, 0, size)
        layer(x, logits)
        cp.cuda.Device().synchronize()
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        print(f"{args.preset} {args.tokens} tokens, {args.dtype} int{args.bits}, knobs {over or 'none'}")
        for name, (tab, _, _) in read_stamps(cp).items():
            print(name)
            for i, kname in enumerate(("FC1", "FC2")):
                summary(kname, tab[i], sms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
