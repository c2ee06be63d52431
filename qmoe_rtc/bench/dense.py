"""The dense bf16 reference of a preset's expert GEMMs at T tokens (GPU and torch needed): what cuBLAS takes for the
layer's FLOPs with bf16 weights and no dequantization, with the GPU's watts and SM clock beside it.

Routing is taken as balanced (T·k / E routes an expert). Two forms: one batched GEMM a projection (``bmm``:
[E, R, H] × [E, H, 2I], the swiglu, then [E, R, I] × [E, I, H]) and the same FLOPs as two whole GEMMs over
every route with one expert's weights (``whole``). Each is one CUDA graph replayed ``--iters`` times, the L2
flushed (a 256 MiB write) before every sample, the median of CUDA-event times printed with its TFLOP/s, the
mean watts (NVML's energy counter over the turn), the median SM clock and the share of polls at the power cap
(qmoe_rtc.bench.power). Where a layer runs at the GPU's power limit this is the bar a quantized engine's time
stands beside (docs/performance.md).

    python -m qmoe_rtc bench dense --preset mixtral-8x7b --tokens 4096
"""

from __future__ import annotations

import argparse
import statistics


def routes_per_expert(tokens: int, k: int, experts: int) -> int:
    """Routes an expert gets under balanced routing (at least one)."""
    return max(1, tokens * k // experts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m qmoe_rtc bench dense", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="mixtral-8x7b")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=300, help="timed samples a form (median printed)")
    args = p.parse_args(argv)

    import torch

    from ..specialize.presets import PRESETS
    from .power import PowerMeter, summarize
    from .report import flop_count
    from .run import FLUSH_BYTES

    pr = PRESETS[args.preset]
    E, H, I = pr.experts, pr.hidden, pr.inter
    R = routes_per_expert(args.tokens, pr.k, E)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=dev)  # the benches' L2 flush, 256 MiB
    w1 = torch.randn(E, H, 2 * I, device=dev, dtype=torch.bfloat16) * 0.02  # [E, H, 2I]
    w2 = torch.randn(E, I, H, device=dev, dtype=torch.bfloat16) * 0.02      # [E, I, H]
    x = torch.randn(E, R, H, device=dev, dtype=torch.bfloat16)              # [E, R, H]

    def batched():
        h = torch.bmm(x, w1)
        return torch.bmm(torch.nn.functional.silu(h[..., :I]) * h[..., I:], w2)

    xs = x.reshape(E * R, H)

    def whole():
        h = xs @ w1[0]
        return (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ w2[0]

    meter = PowerMeter.open(torch.cuda.current_device())
    flops = flop_count(E * R, 1, H, I)  # E·R routes
    print(f"{args.preset}: T {args.tokens}, {E} experts x {R} routes, H {H}, I {I}: {flops / 1e12:.3f} TFLOP")
    for name, fn in (("bmm", batched), ("whole", whole)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        with meter.turn() as turn:
            for _ in range(args.iters):
                flush.zero_()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
        med = statistics.median(times)
        s = summarize([turn], med)
        print(f"{name:6s} median {med:8.1f} us  ({flops / med / 1e6:6.1f} TFLOP/s)  watts {s['watts']:5.0f}  "
              f"SM MHz {s['sm_mhz']:5.0f}  capped {s['capped']:.0%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
