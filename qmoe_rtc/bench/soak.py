"""Memory soak on the GPU: does a serving loop's memory stay flat?

One qwen3-30b-a3b layer (H 2048, I 768, E 128, k 8; int4, block 128, swiglu, built like the
benchmark's: ``qmoe_rtc.bench.layers.build_layer``). Two phases, each after its own warm-up:

1. ``--replays`` replays of a CUDA graph from ``QMoE.capture`` at 1 token (new inputs copied into
   the graph's arrays before each replay, from a bank of ``--bank`` random inputs);
2. ``--eager`` eager calls ``moe(x, logits)`` (output allocated per call, as a caller would) at batch
   sizes drawn uniformly from 1..``--max-batch`` (seeded), after every size has been planned once.

Every ``--every`` iterations (device synchronised first) it samples: device memory in use
(``cudaMemGetInfo``: total - free), CuPy's memory pool (used and held bytes), the host's resident
set (``VmRSS`` from /proc/self/status) and the number of Python objects the collector tracks. It
prints one table row per sample and, per phase and metric, the growth after warm-up: the maximum
over the last quarter of the phase's samples minus the maximum over its first quarter. The last
line is the verdict: ``FLAT`` when every growth is within ``--tol-device-mib`` (device and pool),
``--tol-host-mib`` (RSS) and ``--tol-objects``, else ``GROWING``. Exit status: 0 flat, 1 growing,
2 no usable GPU or a failed run.

    python -m qmoe_rtc bench soak                              # the full soak (about 100 000 + 10 000 calls)
    python -m qmoe_rtc bench soak --replays 2000 --eager 500   # a short run
    python -m qmoe_rtc bench soak --json soak.json             # also the samples as JSON

Imports nothing from CuPy, NumPy or the rest of qmoe_rtc until it runs (``--help`` works without a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time

METRICS = ("device_mib", "pool_used_mib", "pool_held_mib", "rss_mib", "objects")
MIB = float(1 << 20)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=100_000, help="graph replays at 1 token (default: 100000)")
    p.add_argument("--eager", type=int, default=10_000, help="eager calls at random batch sizes (default: 10000)")
    p.add_argument("--max-batch", type=int, default=64, help="largest eager batch size; sizes are 1..this (default: 64)")
    p.add_argument("--every", type=int, default=0,
                   help="iterations between samples (default: about 50 samples per phase)")
    p.add_argument("--warmup", type=float, default=0.05,
                   help="fraction of each phase run before the first sample (default: 0.05)")
    p.add_argument("--bank", type=int, default=64, help="distinct random inputs cycled through (default: 64)")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16", help="activation dtype (default: bfloat16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the layer, the inputs and the batch sizes (default: 0)")
    p.add_argument("--tol-device-mib", type=float, default=8.0,
                   help="allowed growth of device memory and of the CuPy pool, MiB (default: 8)")
    p.add_argument("--tol-host-mib", type=float, default=16.0, help="allowed growth of the host RSS, MiB (default: 16)")
    p.add_argument("--tol-objects", type=int, default=2000,
                   help="allowed growth of the Python objects the collector tracks (default: 2000)")
    p.add_argument("--json", metavar="PATH", help="also write the samples, growths and verdict as JSON")
    return p


def rss_mib() -> float:
    """Resident set size of this process (VmRSS), MiB; NaN where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def growth(samples: list[dict]) -> dict:
    """Per metric: max over the last quarter of ``samples`` minus max over the first quarter."""
    if not samples:
        return {m: 0.0 for m in METRICS}
    q = max(1, len(samples) // 4)
    head, tail = samples[:q], samples[-q:]
    return {m: max(s[m] for s in tail) - max(s[m] for s in head) for m in METRICS}


def verdict(growths: dict[str, dict], tol_device: float, tol_host: float, tol_objects: float) -> tuple[bool, list[str]]:
    """(flat?, the growths beyond tolerance as text) over every phase's growths."""
    limits = {"device_mib": tol_device, "pool_used_mib": tol_device, "pool_held_mib": tol_device, "rss_mib": tol_host,
              "objects": tol_objects}
    over = [f"{phase} {m} +{g[m]:.1f} (> {limits[m]})" for phase, g in growths.items() for m in METRICS
            if g[m] > limits[m]]
    return not over, over


def _row(s: dict) -> str:
    return (f"{s['phase']:<7} {s['iter']:>8} {s['elapsed_s']:>8.1f} {s['device_mib']:>10.1f} {s['pool_used_mib']:>9.1f} "
            f"{s['pool_held_mib']:>9.1f} {s['rss_mib']:>9.1f} {s['objects']:>9d}")


HEADER = (f"{'phase':<7} {'iter':>8} {'time_s':>8} {'device_MiB':>10} {'pool_MiB':>9} {'held_MiB':>9} {'rss_MiB':>9} "
          f"{'objects':>9}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import cupy as cp
        import numpy as np

        from .._arrays import np_dtype
        from ..errors import QMoEError
        from ..executor import QMoE
        from ..jit.driver import probe
        from .layers import build_layer
        from .report import BENCH_SHAPES

        probe(0)
    except Exception as exc:  # no GPU, no driver, no CuPy: nothing to soak
        print(f"soak: no usable GPU ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
              file=sys.stderr)
        return 2

    shape = BENCH_SHAPES["qwen3-30b-a3b"]
    rs = cp.random.RandomState(args.seed)
    rng = np.random.default_rng(args.seed)
    dev = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    print(f"soak on {name}: {shape.name} H={shape.H} I={shape.I} E={shape.E} k={shape.k}, int4 block "
          f"{shape.block_size}, {args.dtype}; {args.replays} graph replays at 1 token, {args.eager} eager calls at "
          f"1..{args.max_batch} tokens", flush=True)
    try:
        weights, attrs = build_layer(cp, rs, shape, args.dtype, (4, 4), shape.block_size, False)
        moe = QMoE(**weights, **attrs)
    except QMoEError as exc:
        print(f"soak: layer refused: {exc}", file=sys.stderr)
        return 2
    pool = cp.get_default_memory_pool()
    dt = np_dtype(args.dtype)
    xbank = rs.standard_normal((args.bank, args.max_batch, shape.H), dtype=cp.float32).astype(dt)
    lbank = 2 * rs.standard_normal((args.bank, args.max_batch, shape.E), dtype=cp.float32)
    samples: list[dict] = []
    t0 = time.perf_counter()

    def sample(phase: str, i: int) -> None:
        cp.cuda.Device().synchronize()
        free, total = cp.cuda.runtime.memGetInfo()
        s = dict(phase=phase, iter=i, elapsed_s=time.perf_counter() - t0, device_mib=(total - free) / MIB,
                 pool_used_mib=pool.used_bytes() / MIB, pool_held_mib=pool.total_bytes() / MIB, rss_mib=rss_mib(),
                 objects=len(gc.get_objects()))
        samples.append(s)
        print(_row(s), flush=True)

    def every(n: int) -> int:
        return args.every or max(1, n // 50)

    print(HEADER, flush=True)
    # phase 1: graph replays at 1 token
    x, logits = xbank[0, :1].copy(), lbank[0, :1].copy()
    moe(x, logits)
    graph = moe.capture(x, logits)
    warm, step = int(args.replays * args.warmup), every(args.replays)
    for i in range(args.replays):
        j = i % args.bank
        cp.copyto(x, xbank[j, :1])
        cp.copyto(logits, lbank[j, :1])
        graph.replay()
        if i >= warm and (i - warm) % step == 0 or i == args.replays - 1:
            sample("graph", i + 1)
    ok = bool(cp.isfinite(graph.output).all())
    # phase 2: eager calls at random batch sizes (every size planned first: planning is warm-up)
    sizes = rng.integers(1, args.max_batch + 1, size=args.eager)
    for b in range(1, args.max_batch + 1):
        moe(xbank[0, :b], lbank[0, :b])
    warm, step = int(args.eager * args.warmup), every(args.eager)
    for i, b in enumerate(sizes):
        j = i % args.bank
        y = moe(xbank[j, :b], lbank[j, :b])
        if i >= warm and (i - warm) % step == 0 or i == args.eager - 1:
            ok = ok and bool(cp.isfinite(y).all())
            sample("eager", i + 1)
    del y

    growths = {ph: growth([s for s in samples if s["phase"] == ph]) for ph in ("graph", "eager")}
    flat, over = verdict(growths, args.tol_device_mib, args.tol_host_mib, args.tol_objects)
    for ph, g in growths.items():
        print(f"growth after warm-up, {ph}: " + ", ".join(f"{m} {g[m]:+.1f}" for m in METRICS))
    if not ok:
        print("soak: a sampled output held a non-finite value", file=sys.stderr)
    tol = f"tolerance {args.tol_device_mib} MiB device/pool, {args.tol_host_mib} MiB host, {args.tol_objects} objects"
    line = f"verdict: {'FLAT' if flat else 'GROWING'} ({tol}" + ("" if flat else "; over: " + "; ".join(over)) + ")"
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), device=name, samples=samples, growth=growths, flat=flat,
                           outputs_finite=ok, verdict=line), f, indent=1)
    if not ok:
        return 2
    return 0 if flat else 1


if __name__ == "__main__":
    sys.exit(main())
