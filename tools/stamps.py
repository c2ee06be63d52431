"""Where the time of a layer's kernels goes, from stamps the kernels write themselves (core/stamps.cuh), on the GPU.

``wgmma``: the one-block-per-tile wgmma prefill kernels (tuning knob ``prefill_wg_stamps``). Builds a bench shape's
random int layer, runs one call to warm up and one measured call, and prints per kernel (FC1, FC2): blocks, chunks
per tile, and thread 0's cycles split into prologue (entry to main loop), main loop per chunk (waiting for copies and
the chunk barrier / the rest) and epilogue, then the kernel's span and how full the SMs were (the sum of the tiles'
durations over span × SMs).

``decode``: the decode chain's timeline inside one CUDA-graph replay (tuning knob ``decode_stamps``). Captures a
forward of T tokens, replays it to warm up, times replays with CUDA events (the L2 flushed before each) and keeps
the stamps of the last. Prints, in µs from the first FC1 block's entry, when FC1's blocks entered, saw the routing
done (or routed the call themselves: knob route_in_decode), found their routes, finished their loop and left, and the
same for FC2 (scanned: its route scan done; act ready: its expert's FC1 tiles written), each step's first / median /
last block; then the replay's event time against the span the two kernels cover (the rest: the routing kernel before
FC1's first block where there is one, launch, tail).

``chain`` (no stamps): where a forward's time goes across its launches. Captures a forward of T tokens and times,
with the L2 flushed before every sample, its replay, each prefix of its launches (route, route + group, ...) as a
graph of its own, and the launches from FC1 on alone (the GEMMs and the combine, reading what the full forward left
in the scratch: the same routes), from FC2 on, and the combine alone. "chain cost" = the replay minus FC1-on alone:
what the launches before FC1 add, overlap included. Each graph pays its own launch: prefixes are upper bounds.

The stamps cost a few instructions a block (wgmma: a chunk); compare timings with a build without them (``bench
ab``), not with this one.

  PYTHONPATH=. python tools/stamps.py wgmma --preset mixtral-8x7b --tokens 4096 [--knob prefill_group=4]
  PYTHONPATH=. python tools/stamps.py decode --preset qwen3-30b-a3b --tokens 1,2 [--knob mma_expert_flow=0]
  PYTHONPATH=. python tools/stamps.py chain --preset gpt-oss-120b --tokens 8,16,32,64 [--knob route_in_group=off]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import numpy as np


@contextlib.contextmanager
def stamped_layer(args, over: dict):
    """(cupy, its random generator, the bench shape, the layer): a bench shape's random int layer built inside the
    knobs ``over`` and ``--knob NAME=VALUE``, which stay set while the caller runs it (its kernels compile then)."""
    import cupy as cp

    from qmoe_rtc.bench.layers import build_layer
    from qmoe_rtc.bench.report import BENCH_SHAPES
    from qmoe_rtc.contract.extensions import EXT_INPUTS
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.settings import knobs

    for kv in args.knob:
        k, _, v = kv.partition("=")
        over[k] = knobs.KNOBS[k].parse(v)
    shape = BENCH_SHAPES[args.preset]
    rs = cp.random.default_rng(1)
    with knobs.scope(**over):
        weights, attrs = build_layer(cp, rs, shape, args.dtype, (args.bits, args.bits), shape.block_size, False,
                                     swiglu_fusion=args.swiglu_fusion)
        for n in [n for n in weights if n in EXT_INPUTS]:
            weights.pop(n)
        yield cp, rs, shape, QMoE(**weights, **attrs)


def stamp_tables(prefix: str, symbol: bytes) -> dict[str, tuple[int, int]]:
    """(device address, bytes) of the stamps table ``symbol`` of every loaded module (the JIT cache's) whose name
    starts with ``prefix`` and that is one program (a stamped build is)."""
    from qmoe_rtc.jit import cache, driver

    drv = driver.bindings()
    out = {}
    for lm in list(cache._loaded.values()):
        if lm.name.startswith(prefix) and len(lm.modules) == 1:
            err, ptr, size = drv.cuModuleGetGlobal(lm.modules[0], symbol)
            if int(err) == 0:
                out[lm.name] = (int(ptr), int(size))
    return out


def fetch(cp, ptr: int, size: int, row: int) -> np.ndarray:
    """A stamps table copied to the host: [2 kernels, blocks, row] i64."""
    host = np.empty(size // 8, np.int64)
    cp.cuda.runtime.memcpy(host.ctypes.data, ptr, size, cp.cuda.runtime.memcpyDeviceToHost)
    return host.reshape(2, -1, row)


def read_wg_stamps(cp):
    """{module name: (table [2 kernels, blocks, 8], device address, bytes)} of the stamped wgmma prefill modules."""
    return {n: (fetch(cp, ptr, size, 8), ptr, size) for n, (ptr, size) in stamp_tables("wgmma_prefill",
                                                                                        b"qmoe_wg_stamps").items()}


def wg_summary(name: str, s: np.ndarray, sms: int) -> None:
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


def wgmma(args) -> int:
    over = {"prefill_wg_stamps": True, "prefill_engine": "wgmma"}  # --knob prefill_engine=... for another engine
    with stamped_layer(args, over) as (cp, rs, shape, layer):
        x = rs.standard_normal((int(args.tokens), shape.H), dtype=cp.float32).astype(args.dtype)
        logits = 2 * rs.standard_normal((int(args.tokens), shape.E), dtype=cp.float32)
        layer(x, logits)
        cp.cuda.Device().synchronize()
        tables = read_wg_stamps(cp)
        if not tables:
            print("no stamped wgmma prefill module ran (is this an sm_90 device and a prefill-sized call?)")
            return 1
        for _, ptr, size in tables.values():
            cp.cuda.runtime.memset(ptr, 0, size)
        layer(x, logits)
        cp.cuda.Device().synchronize()
        sms = cp.cuda.Device().attributes["MultiProcessorCount"]
        print(f"{args.preset} {args.tokens} tokens, {args.dtype} int{args.bits}, knobs {over or 'none'}")
        for name, (tab, _, _) in read_wg_stamps(cp).items():
            print(name)
            for i, kname in enumerate(("FC1", "FC2")):
                wg_summary(kname, tab[i], sms)
    return 0


# -- the decode chain --------------------------------------------------------------------------------
KERNELS = ("FC1", "FC2")
STEPS = {"FC1": ("entry", "routed", "routes", "loop end", "exit"),
         "FC2": ("entry", "scanned", "act ready", "loop end", "exit")}


def read_decode_stamps(cp) -> dict[str, np.ndarray]:
    """{module name: table [2 kernels, blocks, 6]} of the stamped decode modules."""
    return {n: fetch(cp, ptr, size, 6) for n, (ptr, size) in stamp_tables("mma_decode", b"qmoe_decode_stamps").items()}


def clear_decode_stamps(cp) -> None:
    """Zero every stamped decode module's table (blocks that do not run stay zero: the timeline skips them)."""
    for ptr, size in stamp_tables("mma_decode", b"qmoe_decode_stamps").values():
        cp.cuda.runtime.memset(ptr, 0, size)


def timeline(tab: np.ndarray) -> list[str]:
    """The lines of one forward's timeline from its stamps [2 kernels, blocks, 6] (rows of blocks that did not run
    are zero): per kernel the blocks that ran and served routes, then per step its first / median / last block in µs
    from the first FC1 entry."""
    live = [k[k[:, 0] > 0] for k in tab]
    if not len(live[0]):
        return ["no FC1 block recorded a stamp (did the decode path run?)"]
    t0 = live[0][:, 0].min()
    lines = []
    for name, rows in zip(KERNELS, live):
        if not len(rows):
            lines.append(f"{name}: no block recorded")
            continue
        served = rows[(rows[:, 5] & 0xFFFFFFFF) > 0]
        sms = len(np.unique(rows[:, 5] >> 32))
        lines.append(f"{name}: {len(rows)} blocks on {sms} SMs, {len(served)} served routes "
                     "(µs from FC1's first entry: first / median / last block)")
        for i, step in enumerate(STEPS[name]):
            pick = rows if i in (0, 1, 4) or not len(served) else served  # routes and loop: the blocks that served
            v = (pick[:, i] - t0) / 1e3
            lines.append(f"  {step:<10} {v.min():8.2f} {np.median(v):8.2f} {v.max():8.2f}")
        if len(served):
            loop = (served[:, 3] - served[:, 2]) / 1e3
            lines.append(f"  loop       {np.median(loop):8.2f} µs a block median, {loop.max():.2f} max")
    return lines


def decode(args) -> int:
    over = {"decode_stamps": True}
    with stamped_layer(args, over) as (cp, rs, shape, layer):
        flush = cp.empty(256 << 20, dtype=cp.uint8)
        print(f"{args.preset}, {args.dtype} int{args.bits}, knobs {over}")
        for T in (int(t) for t in args.tokens.split(",")):
            x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(args.dtype)
            logits = 2 * rs.standard_normal((T, shape.E), dtype=cp.float32)
            pipeline = layer.engine_for(T, args.dtype).pipeline.name
            graph = layer.capture(x, logits)
            stream = cp.cuda.get_current_stream()
            times = []
            for i in range(args.iters + 3):
                flush.fill(i & 0xFF)
                clear_decode_stamps(cp)
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                graph.replay()
                b.record(stream)
                b.synchronize()
                if i >= 3:
                    times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
            tables = read_decode_stamps(cp)
            print(f"\n{T} tokens, {pipeline}: replay {np.median(times):.2f} µs median of {len(times)} (L2 flushed)")
            if not tables:
                print("  no stamped decode module ran (the decode path did not take this call)")
                continue
            for name, tab in tables.items():
                live = tab[:, :, 0] > 0
                if not live.any():
                    continue
                print(f"  {name}")
                lines = timeline(tab)
                print("\n".join("  " + ln for ln in lines))
                ends = tab[1][live[1]][:, 4] if live[1].any() else tab[0][live[0]][:, 4]
                span = (ends.max() - tab[0][live[0]][:, 0].min()) / 1e3
                print(f"    kernels' span {span:.2f} µs of the replay's {np.median(times):.2f} (the rest: the routing "
                      "launch before FC1's first block where there is one, launch, tail)")
    return 0


class Part:
    """Launches [lo, hi) of bound launches ``b`` (runtime/plan.py BoundLaunches), the first never overlapped: what
    runtime/graph.py capture_launches records for ``chain``."""

    def __init__(self, b, lo: int, hi: int):
        self.b, self.lo, self.hi = b, lo, hi

    def launch(self, stream: int, ptrs: tuple) -> None:
        b = self.b
        items, overlapped = b.items, b.overlapped
        b.items, b.overlapped = items[self.lo:self.hi], (None, *overlapped[self.lo + 1:self.hi])
        try:
            b.launch(stream, ptrs)
        finally:
            b.items, b.overlapped = items, overlapped


def chain(args) -> int:
    """The ``chain`` mode (module docstring)."""
    import statistics

    from qmoe_rtc._arrays import np_dtype
    from qmoe_rtc.bench.run import Timer
    from qmoe_rtc.runtime.graph import capture_launches
    from qmoe_rtc.runtime.interop import data_ptr

    with stamped_layer(args, {}) as (cp, rs, shape, moe):
        timer = Timer(cp)
        for T in (int(t) for t in args.tokens.split(",")):
            x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype(args.dtype))
            logits = cp.asarray(2 * rs.standard_normal((T, shape.E)), dtype=cp.float32)
            g = moe.capture(x, logits)
            call = next(c for c in moe._calls.values() if c.plan is not None and c.spec.rows == T)
            b, roles = call.bound, [st.role for st in call.plan.steps]
            if "fc1" not in roles:
                print(f"{args.preset} T={T}: {call.plan.engine} has no FC1 launch of its own; skipped")
                continue
            n, fc1 = len(roles), roles.index("fc1")
            ptrs, stream = (data_ptr(x), data_ptr(logits), 0, data_ptr(g.output)), cp.cuda.get_current_stream().ptr
            full = statistics.median(timer.samples_us(g.replay, args.iters, 5))
            us = {}
            for lo, hi in [(0, i) for i in range(1, n + 1)] + [(fc1, n), (fc1 + 1, n), (n - 1, n)]:
                graph = capture_launches(Part(b, lo, hi), stream, ptrs, moe.device_id)
                us[lo, hi] = statistics.median(timer.samples_us(graph.launch, args.iters, 5))
            g.replay()  # the scratch as the full forward leaves it
            print(f"{args.preset} T={T} {call.plan.engine}: replay {full:.1f} µs; launches {' → '.join(roles)}")
            print("  prefixes: " + ", ".join(f"{'+'.join(roles[:hi])} {us[0, hi]:.1f}" for hi in range(1, n + 1)))
            print(f"  FC1 on (GEMMs + combine alone) {us[fc1, n]:.1f}; FC2 on {us[fc1 + 1, n]:.1f}; combine alone "
                  f"{us[n - 1, n]:.1f}; chain cost {full - us[fc1, n]:.1f}", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="engine", required=True, metavar="ENGINE")
    for name, preset, tokens, fusion in (("wgmma", "mixtral-8x7b", "4096", 1), ("decode", "qwen3-30b-a3b", "1,2", 2),
                                         ("chain", "gpt-oss-120b", "8", 1)):
        s = sub.add_parser(name, help="graphs of parts of a forward's launches" if name == "chain"
                           else f"the {name} engine's stamps")
        s.add_argument("--swiglu-fusion", type=int, default=fusion, choices=(1, 2),
                       help=f"swiglu layers' FC1 layout (default {fusion}; 2: the peers benchmark's layer)")
        s.add_argument("--preset", default=preset)
        s.add_argument("--tokens", default=tokens, help="token count (decode: a comma list)")
        s.add_argument("--dtype", default="bfloat16")
        s.add_argument("--bits", type=int, default=4)
        s.add_argument("--iters", type=int, default=20, help="decode, chain: timed samples (median reported)")
        s.add_argument("--knob", action="append", default=[], help="NAME=VALUE (a qmoe_rtc knob, e.g. prefill_group=4)")
    args = p.parse_args(argv)
    return {"wgmma": wgmma, "decode": decode, "chain": chain}[args.engine](args)


if __name__ == "__main__":
    sys.exit(main())
