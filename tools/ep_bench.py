"""Expert-parallel check and benchmark on several GPUs of one host (issue 14): every rank builds the same
layer (same seed), keeps its slice through :class:`qmoe_rtc.distributed.ExpertParallelQMoE`, and

- checks that the expert-parallel output equals the single-GPU layer (rank 0 also runs the whole
  layer; rel err within R times the tolerance of docs/contract.md),
- times, per token count, with CUDA graphs of each step, CUDA events, warm-up and medians (the L2 is
  flushed between samples): the rank's partial layer, the all_reduce alone, the whole
  expert-parallel step (partial + all_reduce) and, on rank 0, the single-GPU layer.

    torchrun --nproc-per-node 2 tools/ep_bench.py --shapes mixtral-8x7b,deepseek-v3-tp8 --tokens 1,8,64,4096

Keep NVLink multicast off (NCCL_NVLS_ENABLE=0). Prints one line per (shape, T) on rank 0.
"""

from __future__ import annotations

import argparse
import os
import statistics


def _median_us(torch, fn, iters: int, flush) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _graph(torch, fn):
    fn()  # eager first: plans the layer, sets up the communicator
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="mixtral-8x7b,deepseek-v3-tp8")
    ap.add_argument("--tokens", default="1,8,64,4096")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np
    import torch
    import torch.distributed as dist

    from qmoe_rtc.bench_layers import build_layer
    from qmoe_rtc.bench_report import BENCH_SHAPES
    from qmoe_rtc.distributed import ExpertParallelQMoE
    from qmoe_rtc.executor import QMoE

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    cp.cuda.Device(torch.cuda.current_device()).use()
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def flush():
        flush_buf.fill_(1)

    tol = 1e-2 * world  # bfloat16
    for name in args.shapes.split(","):
        shape = BENCH_SHAPES[name]
        w, a = build_layer(cp, cp.random.RandomState(1234), shape, "bfloat16", (4, 4), shape.block_size, False,
                           shared=True)
        router = w.pop("router_weight", None)
        w.pop("router_bias", None)
        ep = ExpertParallelQMoE(**w, **a)
        whole = QMoE(**w, **a) if rank == 0 else None
        for T in [int(t) for t in args.tokens.split(",")]:
            g = torch.Generator(device="cuda").manual_seed(T)
            x = torch.randn(T, shape.H, device="cuda", generator=g).to(torch.bfloat16)
            if router is not None:  # the shape's router, computed once outside the layer (same picks on every rank)
                logits = x.float() @ torch.as_tensor(router.astype(cp.float32), device="cuda").T
            else:
                logits = 2 * torch.randn(T, shape.E, device="cuda", generator=g)
            out = torch.empty_like(x)
            part = torch.empty_like(x)
            step = _graph(torch, lambda: ep(x, logits, out=out))
            local = _graph(torch, lambda: ep.local(x, logits, out=part))
            reduce = _graph(torch, lambda: dist.all_reduce(part))
            ep_us = _median_us(torch, step, args.iters, flush)
            local_us = _median_us(torch, local, args.iters, flush)
            ar_us = _median_us(torch, reduce, args.iters, flush)
            step()
            torch.cuda.synchronize()
            line = f"{name:18s} T={T:5d} rank {rank}/{world}: partial {local_us:9.1f} us, all_reduce {ar_us:7.1f} us, " \
                   f"EP step {ep_us:9.1f} us"
            if rank == 0:
                ref = torch.empty_like(x)
                single = _graph(torch, lambda: whole(x, logits, out=ref))
                single_us = _median_us(torch, single, args.iters, flush)
                single()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).norm().item() / max(ref.float().norm().item(), 1e-30)
                ok = "ok" if np.isfinite(err) and err <= tol else "FAIL"
                line += f", single GPU {single_us:9.1f} us, ratio {ep_us / single_us:5.2f}, rel err {err:.2e} {ok}"
            print(line, flush=True)
        ep = whole = None  # free this shape's layers before the next
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
