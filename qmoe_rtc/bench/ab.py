"""Interleaved A/B of tuning knobs in one process: the same layer built once per knob setting, each
captured as a CUDA graph, then timed in turns (round r times setting 0, 1, …, each ``--iters`` samples
with the L2 flushed before every sample), so clock and thermal drift fall on every setting alike.
A separate bench process per setting sees ~3 % between runs of the same code; this is for differences
smaller than that.

    python -m qmoe_rtc bench ab --preset mixtral-8x7b,gpt-oss-120b --tokens 1,8 \
        mma_expert_flow=0 mma_expert_flow=1 mma_target_warps=6336
    python -m qmoe_rtc bench ab --preset mixtral-8x7b --tokens 4096 --grid decode_max_routes=0 \
        --grid prefill_wg_stages=3,4 --grid prefill_route_tile=128,256
    python -m qmoe_rtc bench ab --preset mixtral-8x7b --tokens 4096 --codes uniform --swiglu-fusion 2 base

The layer is the benchmark's (``bench``: Gaussian weights quantized, FC1 interleaved); ``--codes uniform
--swiglu-fusion 2`` builds it as the peers' benchmark does, which matters where the GPU runs at its power
limit (mixtral-8x7b at 4096 tokens).

A setting is ``name=value[,name=value]`` with knob names (an operational knob's variable too) (or
``decode_max_routes``, a QMoE() argument); ``base`` is the built-in defaults. ``--grid name=v1,v2``
(repeatable) adds one setting per combination of the grids' values (a sweep; ``decode_max_routes=0``
in a grid keeps every setting on the prefill path). Prints per point and setting the engine, the
median of all samples, the spread of the round medians and the ratio to the first setting, and each
setting's largest difference from the first setting's output relative to its largest element (0: the
same output; the bench checks against the float64 reference). ``--power`` adds the GPU's mean watts, median
SM clock, the share of its polls at the power cap and mJ per call over each setting's turns (NVML; where the
GPU runs at its power limit, the clock it holds follows the work's power: a change faster per cycle draws it
down and keeps part of its gain, about half for the ring's stage barriers at mixtral-8x7b 4096 tokens).
``--write-table FILE`` writes the fastest value of each knob per (shape, tokens) as a tuning table module for the
GPU's arch (:mod:`qmoe_rtc.bench.tune_table`; docs/runtime-compilation.md, "Per-arch tuning tables").
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

#: QMoE() arguments a setting may give besides knobs (``decode_max_routes=0``: the prefill path at every size).
LAYER_ARGS = {"decode_max_routes": int}


def parse_setting(text: str) -> dict:
    """``name=value[,name=value]`` (knob names, an operational knob's variable, or :data:`LAYER_ARGS`) → overrides;
    ``base`` → {}."""
    from ..settings import knobs

    if text == "base":
        return {}
    by_env = {k.var: k.name for k in knobs.KNOBS.values() if k.var}
    out = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = by_env.get(name, name)
        if sep and name in LAYER_ARGS:
            out[name] = LAYER_ARGS[name](value)
            continue
        if not sep or name not in knobs.KNOBS:
            raise SystemExit(f"setting {text!r}: {item!r} is not name=value with a knob name or variable")
        out[name] = knobs.KNOBS[name].parse(value)
    return out


def point(timer, shape, T, layers, x, logits, rounds: int, iters: int, meter=None) -> list[dict]:
    """Graphs of every setting's layer on the same inputs, timed in turns; one row per setting (with a
    :class:`~qmoe_rtc.bench.power.PowerMeter`, also its watts, SM clock and mJ per call over its turns)."""
    from contextlib import nullcontext

    import cupy as cp
    import numpy as np

    from .._arrays import dtype_name
    from ..settings import knobs
    from .run import _poison

    graphs, engines = [], []
    for setting, moe in layers:
        with knobs.scope(**{n: v for n, v in setting.items() if n not in LAYER_ARGS}):
            engines.append(moe.engine_for(T, dtype_name(x)).pipeline.name)
            moe(x, logits)
            g = moe.capture(x, logits)
            _poison(cp, g.output)
            g.replay()
        graphs.append(g)
    cp.cuda.get_current_stream().synchronize()
    outs = [cp.asnumpy(g.output).astype(np.float32) for g in graphs]
    samples = [[] for _ in graphs]
    per_round = [[] for _ in graphs]
    turns = [[] for _ in graphs]
    for _ in range(rounds):
        for i, g in enumerate(graphs):
            with meter.turn() if meter else nullcontext() as t:
                s = timer.samples_us(g.replay, iters, 3)  # synchronised: the turn's energy is all in
            if meter:
                turns[i].append(t)
            samples[i] += s
            per_round[i].append(statistics.median(s))
    base = statistics.median(samples[0])
    scale = float(np.max(np.abs(outs[0]))) or 1.0
    rows = []
    for i, (setting, _) in enumerate(layers):
        med = statistics.median(samples[i])
        rows.append(dict(shape=shape, T=T, setting=setting, engine=engines[i], median_us=med, round_min_us=min(per_round[i]),
                         round_max_us=max(per_round[i]), ratio=med / base,
                         finite=bool(np.isfinite(outs[i]).all()),
                         rel_diff=float(np.max(np.abs(outs[i] - outs[0]))) / scale))
        if meter:
            from .power import summarize

            rows[-1].update(summarize(turns[i], med))
    return rows


def build_parser() -> argparse.ArgumentParser:
    from ..cli.args import csv, names, positive
    from .report import BENCH_SHAPES

    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="*", help="name=value[,name=value] knob sets ('base': the defaults)")
    p.add_argument("--grid", action="append", default=[], metavar="NAME=V1,V2",
                   help="one setting per combination of the grids' values, after the settings (repeatable)")
    p.add_argument("--preset", type=names(BENCH_SHAPES, "bench shape"), default="mixtral-8x7b",
                   help="comma list of bench shapes (default: mixtral-8x7b)")
    p.add_argument("--tokens", type=csv(positive), default="1", help="comma list of token counts (default: 1)")
    p.add_argument("--bits", type=int, default=4, help="expert bits (default: 4)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="activation dtype")
    p.add_argument("--codes", default="quantized", choices=["quantized", "uniform"],
                   help="the experts' codes: Gaussian weights quantized (default, as `bench`), or uniform random codes "
                        "and scales as the peers' benchmark draws them (the GEMMs draw more power on them)")
    p.add_argument("--swiglu-fusion", type=int, default=1, choices=[1, 2],
                   help="FC1's rows: 1 gate and linear interleaved (default, as `bench`), 2 [gate | linear] halves "
                        "(as the peers' benchmark)")
    p.add_argument("--rounds", type=int, default=7, help="rounds of turns (default: 7)")
    p.add_argument("--iters", type=int, default=30, help="samples per setting and round (default: 30)")
    p.add_argument("--power", action="store_true",
                   help="also read the GPU's power and SM clock during every turn (NVML): mean watts, median MHz, the "
                        "share of polls at the power cap, mJ per call (watts x median time); where the GPU runs at its "
                        "power limit, a change faster per cycle can draw the clock down")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--write-table", default=None, metavar="FILE",
                   help="write the fastest value of each knob per (shape, tokens) as a tuning table module for this GPU's "
                        "arch (kernels/tuning/<family>.py's form)")
    return p


def grid_settings(grids: list[str]) -> list[str]:
    """``["a=1,2", "b=3"]`` → ``["a=1,b=3", "a=2,b=3"]``: one setting text per combination."""
    axes = []
    for g in grids:
        name, sep, values = g.partition("=")
        if not sep or not name or not values:
            raise SystemExit(f"--grid {g!r}: expected NAME=V1[,V2...]")
        axes.append([f"{name}={v}" for v in values.split(",")])
    return [",".join(combo) for combo in itertools.product(*axes)] if axes else []


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    texts = a.settings + grid_settings(a.grid)
    if not texts:
        raise SystemExit("bench ab: expected at least one setting (name=value or 'base') or a --grid; got none")
    settings = [parse_setting(s) for s in texts]
    from ..jit.driver import probe

    probe(0)  # no driver, no GPU: one line (a DeviceError) before CuPy is asked
    import cupy as cp

    from .._arrays import np_dtype
    from ..contract.extensions import EXT_INPUTS
    from ..executor import QMoE
    from ..settings import knobs
    from .layers import build_layer
    from .report import BENCH_SHAPES
    from .run import Timer

    timer = Timer(cp)
    meter = None
    if a.power:
        from .power import PowerMeter

        meter = PowerMeter.open(cp.cuda.Device().id)
    rows = []
    print(f"{'shape':16} {'T':>4} {'setting':44} {'engine':15} | {'median_us':>9} {'rounds':>13} {'ratio':>6} | rel_diff"
          + ("  |  watts  SM MHz  capped  mJ/call" if meter else ""))
    for name in a.preset:
        shape = BENCH_SHAPES[name]
        rs = cp.random.RandomState(0)
        w, at = build_layer(cp, rs, shape, a.dtype, (a.bits, a.bits), shape.block_size, False, codes=a.codes,
                            swiglu_fusion=a.swiglu_fusion)
        w = {n: v for n, v in w.items() if n not in EXT_INPUTS}  # the routed layer (logits given), as the bench
        layers = []
        for s in settings:
            args = {n: v for n, v in s.items() if n in LAYER_ARGS}
            with knobs.scope(**{n: v for n, v in s.items() if n not in LAYER_ARGS}):
                layers.append((s, QMoE(**w, **at, **args)))
        for T in a.tokens:
            x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype(a.dtype))
            logits = cp.asarray(2 * rs.standard_normal((T, shape.E)), dtype=cp.float32)
            for r in point(timer, name, T, layers, x, logits, a.rounds, a.iters, meter):
                label = ",".join(f"{k}={v}" for k, v in r["setting"].items()) or "base"
                print(f"{name:16} {T:>4} {label[:44]:44} {r['engine']:15} | {r['median_us']:9.1f} {r['round_min_us']:6.1f}-"
                      f"{r['round_max_us']:<6.1f} {r['ratio']:6.3f} | {r['rel_diff']:.1e}"
                      + (f"  | {r['watts']:6.0f} {r['sm_mhz']:7.0f} {r['capped']:7.0%} {r['mj_per_call']:8.1f}" if meter else "")
                      + ("" if r["finite"] else "  NOT FINITE (unwritten output?)"), flush=True)
                rows.append(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    if a.write_table:
        write_table(a.write_table, rows, cp)
    return 0 if all(r["finite"] for r in rows) else 1


def write_table(path: str, rows: list[dict], cp) -> None:
    """The rows' fastest knob values as the tuning table of the GPU's arch (qmoe_rtc/bench/tune_table.py); each knob
    a setting leaves out ran at its default on this GPU (the arch's table, else the knob table's)."""
    from ..jit.compiler import default_arch
    from ..kernels.arch import ArchSpec
    from ..kernels.tuning import ARCH_KNOBS, knob
    from ..settings import knobs
    from .tune_table import table_source

    dev = cp.cuda.runtime.getDevice()
    name = cp.cuda.runtime.getDeviceProperties(dev)["name"]
    device = ArchSpec(default_arch(dev))
    defaults = {n: knob(n, device) if n in ARCH_KNOBS else knobs.get(n) for n in knobs.KNOBS if knobs.KNOBS[n].tuning}
    with open(path, "w") as f:
        f.write(table_source(rows, defaults, device.family, name.decode() if isinstance(name, bytes) else str(name)))
    print(f"wrote the {device.family} tuning table to {path}")


if __name__ == "__main__":
    sys.exit(main())
