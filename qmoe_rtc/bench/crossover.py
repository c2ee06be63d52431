"""The engine sweep behind ``qmoe_rtc/kernels/engine_choice.py`` (GPU needed): decode-mma, the batched engine and the
wgmma engine forced at every token count on one layer, graph replay, L2 flushed, the engines timed in turns in one
process (``bench ab``'s rounds); the layer is the peers' (uniform codes, ``swiglu_fusion=2``) unless asked otherwise.

Per point: each engine's median (``-`` where it does not run there: decode-mma past 512 routes, wgmma off sm_90a),
the fastest, the engine the default choice runs and how much slower than the fastest it is. At the end the sweep as
a Python literal for ``engine_choice.MEASURED`` (a new arch's data, or a re-measure), and the points where the
default choice is more than ``--tolerance`` slower than the fastest (exit status 1 if any, that are not among
``engine_choice.KNOWN_MISSES``).

    python -m qmoe_rtc bench crossover --preset qwen3-30b-a3b,mixtral-8x7b --tokens 1,2,3,4,8,16,32,64,128,256,512
"""

from __future__ import annotations

import argparse
import sys

#: The engines swept and the settings that force each (QMoE arguments and knobs, as ``bench ab`` reads them).
ENGINES = {
    "decode": ({"decode_max_routes": 512}, "decode-mma"),
    "batched": ({"decode_max_routes": 0, "prefill_engine": "batched"}, "prefill-batched"),
    "wgmma": ({"decode_max_routes": 0, "prefill_engine": "wgmma"}, "prefill-wgmma"),
}
#: What a default choice's pipeline is called in the sweep.
SHORT = {pipeline: name for name, (_, pipeline) in ENGINES.items()}


def build_parser() -> argparse.ArgumentParser:
    from ..cli.args import csv, names, positive
    from .report import BENCH_SHAPES

    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench crossover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", type=names(BENCH_SHAPES, "bench shape"),
                   default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048",
                   help="comma list of bench shapes (default: qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048)")
    p.add_argument("--tokens", type=csv(positive), default="1,2,3,4,6,8,16,32,64,128,256,512",
                   help="comma list of token counts (default: 1,2,3,4,6,8,16,32,64,128,256,512)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"], help="activation dtype")
    p.add_argument("--codes", default="uniform", choices=["quantized", "uniform"],
                   help="the experts' codes (default uniform, as the peers' benchmark; see bench ab)")
    p.add_argument("--swiglu-fusion", type=int, default=2, choices=[1, 2], help="FC1's row order (default 2, the peers')")
    p.add_argument("--rounds", type=int, default=4, help="rounds of turns (default: 4)")
    p.add_argument("--iters", type=int, default=20, help="samples per engine and round (default: 20)")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="how much slower than the fastest the default choice may be at a point (default: 0.03)")
    return p


def point_row(times: dict, default: str) -> tuple[tuple, str, float]:
    """(decode, batched, wgmma) µs with None where an engine did not run, the fastest engine's name, and the default
    choice's time over the fastest (0 where the default ran an engine not swept)."""
    row = tuple(times.get(n) for n in ENGINES)
    ran = {n: t for n, t in times.items() if t is not None}
    best = min(ran, key=ran.get)
    got = ran.get(default)
    return row, best, (got / ran[best] if got else 0.0)


def measured_literal(sweep: dict) -> str:
    """``{shape: {T: (decode, batched, wgmma)}}`` as the literal ``engine_choice.MEASURED`` holds (one sweep)."""
    lines = ["{"]
    for shape, points in sweep.items():
        body = ", ".join(f"{T}: ({', '.join('None' if t is None else f'{t:.1f}' for t in row)})" for T, row in points.items())
        lines.append(f"    {shape!r}: {{{body}}},")
    lines.append("}")
    return "\n".join(lines).replace("'", '"')


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from ..jit.driver import probe

    probe(0)  # no driver, no GPU: one line (a DeviceError) before CuPy is asked
    import cupy as cp

    from .._arrays import np_dtype
    from ..contract.extensions import EXT_INPUTS
    from ..executor import QMoE
    from ..kernels.engine_choice import KNOWN_MISSES
    from ..settings import knobs
    from .ab import LAYER_ARGS, point
    from .layers import build_layer
    from .report import BENCH_SHAPES
    from .run import Timer

    timer = Timer(cp)
    sweep, off = {}, []
    print(f"{'shape':16} {'T':>4} | " + " ".join(f"{n:>9}" for n in ENGINES) + " | fastest  default  vs fastest")
    for name in a.preset:
        shape = BENCH_SHAPES[name]
        rs = cp.random.RandomState(0)
        w, at = build_layer(cp, rs, shape, a.dtype, (4, 4), shape.block_size, False, codes=a.codes,
                            swiglu_fusion=a.swiglu_fusion)
        w = {n: v for n, v in w.items() if n not in EXT_INPUTS}
        layers = []
        for setting, _ in ENGINES.values():
            with knobs.scope(**{n: v for n, v in setting.items() if n not in LAYER_ARGS}):
                layers.append((setting, QMoE(**w, **at, **{n: v for n, v in setting.items() if n in LAYER_ARGS})))
        default = QMoE(**w, **at)
        arch = default.problem(1, a.dtype).arch
        for T in a.tokens:
            x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype(a.dtype))
            logits = cp.asarray(2 * rs.standard_normal((T, shape.E)), dtype=cp.float32)
            rows = point(timer, name, T, layers, x, logits, a.rounds, a.iters)
            times = {n: (r["median_us"] if r["engine"] == pipe else None) for (n, (_, pipe)), r in zip(ENGINES.items(), rows)}
            pipeline = default.engine_for(T, a.dtype).pipeline.name
            chosen = SHORT.get(pipeline, pipeline)
            row, best, ratio = point_row(times, chosen)
            sweep.setdefault(name, {})[T] = row
            cells = " ".join(f"{'-' if t is None else f'{t:.1f}':>9}" for t in row)
            print(f"{name:16} {T:>4} | {cells} | {best:8} {chosen:8} {ratio:6.3f}", flush=True)
            if ratio > 1 + a.tolerance:
                off.append((name, T, chosen, best, ratio, (arch[:-1] if arch.endswith("a") else arch, name, T) in KNOWN_MISSES))
        del layers, default
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\n# the sweep as engine_choice.MEASURED holds it ({arch}):\n{measured_literal(sweep)}")
    for name, T, chosen, best, ratio, known in off:
        print(f"default choice off the fastest: {name} T={T}: {chosen} {ratio:.3f}x {best}"
              + (" (a known miss: engine_choice.KNOWN_MISSES)" if known else ""))
    return 1 if any(not known for *_, known in off) else 0


if __name__ == "__main__":
    sys.exit(main())
