"""Where a forward's time goes across its launches, on the GPU: CUDA graphs of parts of one plan's launches.

Builds a bench shape's random int layer (bf16, the bench's codes), captures one forward at each ``--tokens`` count and
times, with the L2 flushed before every sample (CUDA events, medians):

- the whole forward's replay;
- each prefix of its launches (the first n: route, route + group, ...), each a graph of its own;
- the GEMMs and the combine alone (the launches from FC1 on), from FC2 on, and the combine alone, reading what the
  full forward left in the scratch (the same inputs: the same routes).

"chain cost" = the replay minus the GEMMs and combine alone: what the launches before FC1 add to a forward, overlap
included. Each graph pays its own launch, so the prefixes are upper bounds of their kernels' time.

  PYTHONPATH=. python tools/launch_chain.py --preset gpt-oss-120b --tokens 8,16,32,64 [--knob route_in_group=off]
"""

from __future__ import annotations

import argparse
import statistics


class _Part:
    """Launches [lo, hi) of bound launches ``b`` (the first of them never overlapped), as capture_launches wants."""

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, help="a bench shape (qwen3-30b-a3b, mixtral-8x7b, gpt-oss-120b, ort-2048)")
    p.add_argument("--tokens", default="8", help="comma list of token counts")
    p.add_argument("--iters", type=int, default=40, help="timed samples per graph")
    p.add_argument("--knob", action="append", default=[], help="NAME=VALUE, a tuning knob set while the layer runs")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import cupy as cp

    from qmoe_rtc._arrays import np_dtype
    from qmoe_rtc.bench.layers import build_layer
    from qmoe_rtc.bench.report import BENCH_SHAPES
    from qmoe_rtc.bench.run import Timer
    from qmoe_rtc.contract.extensions import EXT_INPUTS
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.runtime.graph import capture_launches
    from qmoe_rtc.runtime.interop import data_ptr
    from qmoe_rtc.settings import knobs

    over = {}
    for kv in args.knob:
        name, _, value = kv.partition("=")
        over[name] = knobs.KNOBS[name].parse(value)
    shape, timer = BENCH_SHAPES[args.preset], Timer(cp)
    rs = cp.random.RandomState(0)
    with knobs.scope(**over):
        w, at = build_layer(cp, rs, shape, "bfloat16", (4, 4), shape.block_size, False)
        moe = QMoE(**{n: v for n, v in w.items() if n not in EXT_INPUTS}, **at)
        for T in (int(t) for t in args.tokens.split(",")):
            x = rs.standard_normal((T, shape.H), dtype=cp.float32).astype(np_dtype("bfloat16"))
            logits = cp.asarray(2 * rs.standard_normal((T, shape.E)), dtype=cp.float32)
            g = moe.capture(x, logits)
            call = next(c for c in moe._calls.values() if c.plan is not None and c.spec.rows == T)
            b, roles = call.bound, [st.role for st in call.plan.steps]
            if "fc1" not in roles:
                print(f"{args.preset} T={T}: {call.plan.engine} has no FC1 launch of its own; skipped")
                continue
            ptrs, stream, n = (data_ptr(x), data_ptr(logits), 0, data_ptr(g.output)), cp.cuda.get_current_stream().ptr, len(roles)
            full = statistics.median(timer.samples_us(g.replay, args.iters, 5))
            fc1 = roles.index("fc1")
            parts = [(0, i) for i in range(1, n + 1)] + [(fc1, n), (fc1 + 1, n), (n - 1, n)]
            us = {}
            for lo, hi in parts:
                graph = capture_launches(_Part(b, lo, hi), stream, ptrs, moe.device_id)
                us[lo, hi] = statistics.median(timer.samples_us(graph.launch, args.iters, 5))
            g.replay()  # the scratch as the full forward leaves it
            print(f"{args.preset} T={T} {call.plan.engine}: replay {full:.1f} µs; launches {' → '.join(roles)}")
            print("  prefixes: " + ", ".join(f"{'+'.join(roles[:hi])} {us[0, hi]:.1f}" for hi in range(1, n + 1)))
            print(f"  FC1 on (GEMMs + combine alone) {us[fc1, n]:.1f}; FC2 on {us[fc1 + 1, n]:.1f}; combine alone "
                  f"{us[n - 1, n]:.1f}; chain cost {full - us[fc1, n]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
