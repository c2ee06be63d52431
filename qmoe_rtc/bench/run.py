"""Benchmark QMoE layers on the GPU: ``python -m qmoe_rtc bench run`` (``bench`` without a subcommand too).

What is measured, per point (shape × dtype × layer quantization × tokens T), on ONE layer built per (shape,
dtype, weight format, bits and block size) on the GPU (random float32 experts ·1/sqrt(K), quantized with
:func:`qmoe_rtc.formats.quantize.quantize` on CuPy, scales in the activation dtype; swiglu, swiglu_fusion=1,
normalize_routing_weights=1):

- **graph_us**: replay of a CUDA graph from ``QMoE.capture`` (what a serving loop would run);
- **eager_us**: ``moe(x, logits, out=out)`` (Python launch overhead included);
- **torch_us**: a PyTorch baseline (weights dequantized once to the activation dtype; per forward:
  softmax top-k, per-expert loop over the experts that got tokens, matmul FC1, swiglu, FC2,
  weighted ``index_add_``), when torch is importable.

How: CUDA events on the current stream; warm-up first; each sample = write a 256 MiB scratch buffer
(flushes the L2, outside the timed region), start event, the work, end event; all elapsed times are
read after one final synchronize; the median of ``--iters`` samples is reported.

Correctness on every point: the graph output and the eager output (both poisoned with NaN before
the run) against the float64 CPU reference :func:`qmoe_rtc.contract.reference.qmoe` (at most ``--check-rows``
rows per point; the reference runs once per layer over the checked rows of every T, which is exact
because rows are independent). ‖out−ref‖/‖ref‖ must meet the tolerance of docs/contract.md.

Floor: max(bytes / copy bandwidth, FLOPs / matmul rate), both ceilings measured in the same run
(1 GiB device-to-device copy counting read+write; 8192³ bf16 matmul through torch, float16 through
CuPy without torch). Bytes = the unique experts
chosen by the true routing over the T tokens × their packed weights + scales + zero points, plus
input, output and logits. FLOPs = 2·T·k·(H·2I + I·H). ``%floor`` = floor_us / graph_us · 100.

Shapes with [ext] parts (qwen3-next-80b-a3b, deepseek-v3-tp8: shared experts, router GEMM) time up to
three layers per point (``--variants``): ``routed`` (routed experts only), ``shared`` (+ shared
experts), both called with the logits the router GEMM gives (x·Wᵀ on the host, so all route alike),
and ``full`` (+ router GEMM, ``router_probs`` None; rows whose k-th and (k+1)-th logits nearly tie are
left out of its check). Their floors add the shared experts' bytes (+ gate) and the router weight's,
and their FLOPs. Target: full_us <= 1.15·(routed_us + (shared + router bytes) / copy rate).

``--format`` picks the weight formats (:mod:`qmoe_rtc.formats`; ``--bits`` the widths of ``int``):
``fp8_e4m3``: FP8 e4m3 experts, float32 block scales, or one global scale per expert with block size 0
(``--format fp8_e4m3:0``); 1 byte per weight + scales in the floor. ``mxfp4`` / ``nvfp4``: FP4 e2m1 experts in
that format; a nibble per weight + a byte per block in the floor (the engines hold float32 block scales).
The old ``--bits fp8`` / ``fp8g`` / ``mxfp4`` / ``nvfp4`` are refused with a message naming the new spelling.
Per (shape, dtype), against int at ``--bits 8`` of the same run: FP8 %floor at 1 token >= 80 % of int8's, FP8
time at 4096 tokens <= 1.2× int8's. Decode (default shapes, int4): %floor at 1-8 tokens vs the
shape's target, int2 <= 0.65× int4 at 1 token on mixtral and gpt-oss (``bench/targets.py``). Targets print
PASS / MISS and go to the JSON's ``targets``; a MISS does not fail the run.

A failing point prints ``ERR`` with the reason and the run goes on; the exit code is non-zero if any
point failed.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict

import numpy as np

from .layers import prepare_layer
from .report import (
    TOL,
    _reason,
    block_for,
    ext_flops,
    floor_bytes,
    flop_count,
    format_row,
    label_width,
    layout_problem,
    near_tie_rows,
    parse_args,
    rel_err,
    table_header,
    variants_for,
)
from .targets import EXT_FACTOR, decode_targets, ext_target, format_target, fp8_targets
from .torch_ref import torch_moe, torch_weights

__all__ = ["Timer", "copy_rates", "main"]

FLUSH_BYTES = 256 << 20  # L2 flush buffer (H200 L2: 60 MB)
COPY_BYTES = 1 << 30  # bandwidth probe: a device-to-device copy of this size
MATMUL_N = 8192  # matmul probe: N×N×N


# -- GPU -------------------------------------------------------------------------------------------
def _poison(cp, a) -> None:
    """Fill with NaN bit patterns (0x7FFF is NaN in float16 and bfloat16), without float arithmetic."""
    a.view(cp.uint16 if a.itemsize == 2 else cp.uint32).fill(0x7FFF if a.itemsize == 2 else 0x7FFFFFFF)


def _d2d(dst, src) -> None:
    """cudaMemcpyAsync device to device on the current stream."""
    dst.data.copy_from_device_async(src.data, src.nbytes)


class Timer:
    """Event-timed samples on the current stream, each preceded by an L2 flush outside the events."""

    def __init__(self, cp, flush_bytes: int = FLUSH_BYTES):
        self.cp = cp
        self.buf = cp.empty(flush_bytes, dtype=cp.uint8)

    def samples_us(self, fn, iters: int, warmup: int, flush: bool = True) -> list[float]:
        cp = self.cp
        for _ in range(warmup):
            fn()
        ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
        for i, (a, b) in enumerate(ev):
            if flush:
                self.buf.fill(i & 0xFF)
            a.record()
            fn()
            b.record()
        ev[-1][1].synchronize()
        return [cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in ev]

    def median_us(self, fn, iters: int, warmup: int, flush: bool = True) -> float:
        return statistics.median(self.samples_us(fn, iters, warmup, flush))


def copy_rates(cp, timer: Timer) -> dict:
    """Device-to-device copy rates of COPY_BYTES (read + write bytes, median of 10, not flushed): cudaMemcpy's, a
    copy kernel's and the larger (``copy_GBps``, the bytes floor's rate)."""
    src = cp.random.RandomState(1).random_sample(COPY_BYTES // 4, dtype=cp.float32)
    dst = cp.empty_like(src)
    out = {}
    for name, fn in (("memcpy", lambda: _d2d(dst, src)), ("kernel", lambda: cp.copyto(dst, src))):
        out[f"copy_{name}_GBps"] = 2 * src.nbytes / timer.median_us(fn, 10, 2, flush=False) / 1e3
    out["copy_GBps"] = max(out["copy_memcpy_GBps"], out["copy_kernel_GBps"])
    return out


def measure_ceilings(cp, timer: Timer, torch) -> dict:
    """Copy bandwidth (1 GiB D2D, read+write bytes) and dense matmul rate (8192³), median of 10."""
    out = {}
    try:
        out.update(copy_rates(cp, timer))
    except Exception as exc:  # the bytes floor is then left out, the run goes on
        out["copy_GBps"], out["copy_error"] = None, _reason(exc)
    N = MATMUL_N
    try:
        if torch is not None:
            a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
            out["matmul_source"] = f"torch bfloat16 {N}^3"
        else:
            rs = cp.random.RandomState(2)
            a, b = (rs.standard_normal((N, N), dtype=cp.float32).astype(cp.float16) for _ in range(2))
            out["matmul_source"] = f"cupy float16 {N}^3"
        t = timer.median_us(lambda: a @ b, 10, 3, flush=False)
        out["matmul_TFLOPs"] = 2 * N**3 / t / 1e6
    except Exception as exc:  # the FLOP floor is then left out, the run goes on
        out["matmul_TFLOPs"], out["matmul_error"] = None, _reason(exc)
    return out


def _time_point(cp, timer, ceil, args, moe, p, x, logits, lh, rows, ref, per_expert, act_itemsize,
                ext=(0, 0), keep=None) -> None:
    """Floors, correctness of the graph and eager outputs, and their timings, into the point ``p``.
    ``logits`` is what the layer is called with (None: its router GEMM makes them), ``lh`` the host
    logits of the routing; ``ext`` the (bytes, FLOPs) beyond the routed experts; ``keep`` the checked
    rows compared (near-ties of the router GEMM's logits left out)."""
    T, k, H = p["T"], p["k"], p["H"]
    nbytes, uniq = floor_bytes(lh, k, H, per_expert, act_itemsize)
    nbytes, flops = nbytes + ext[0], flop_count(T, k, H, p["I"]) + ext[1]
    bw, mm = ceil.get("copy_GBps"), ceil.get("matmul_TFLOPs")
    p.update(floor_bytes=nbytes, unique_experts=uniq, flops=flops, bytes_floor_us=nbytes / (bw * 1e3) if bw else None,
             flop_floor_us=flops / (mm * 1e6) if mm else None)
    p["floor_us"] = max(p["bytes_floor_us"] or 0.0, p["flop_floor_us"] or 0.0) or None
    p["bound"] = "flop" if p["floor_us"] and p["floor_us"] == p["flop_floor_us"] else "bytes"
    out = cp.empty_like(x)
    _poison(cp, out)
    moe(x, logits, out=out)
    g = moe.capture(x, logits)
    _poison(cp, g.output)
    g.replay()
    cp.cuda.get_current_stream().synchronize()
    sel = slice(None) if keep is None else keep
    if keep is not None:
        p["tie_rows_skipped"] = int(len(keep) - np.count_nonzero(keep))
    p["rel_err_graph"] = rel_err(cp.asnumpy(g.output)[rows][sel], ref[sel])
    p["rel_err_eager"] = rel_err(cp.asnumpy(out)[rows][sel], ref[sel])
    p["rel_err"], p["tol"] = max(p["rel_err_graph"], p["rel_err_eager"]), TOL[p["dtype"]]
    p["ok"] = p["rel_err"] <= p["tol"]
    s = timer.samples_us(g.replay, args.iters, args.warmup)
    p.update(graph_us=statistics.median(s), graph_min_us=min(s))
    p["pct_floor"] = 100.0 * p["floor_us"] / p["graph_us"] if p["floor_us"] else None
    if not args.no_eager:
        p["eager_us"] = timer.median_us(lambda: moe(x, logits, out=out), args.iters, args.warmup)
    if args.host:
        p["host_us"], p["host_p90_us"] = host_time_us(cp, lambda: moe(x, logits, out=out))
        p["host_alloc_us"], _ = host_time_us(cp, lambda: moe(x, logits))
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            tx, tl = torch.from_dlpack(x), None if logits is None else torch.from_dlpack(logits)
            to = torch.empty_like(tx)
            p["host_torch_us"], _ = host_time_us(cp, lambda: moe(tx, tl, out=to))


def host_time_us(cp, fn, calls: int = 1000) -> tuple[float, float]:
    """Median and 90th percentile CPU time of ``fn()`` (entering the call to its return: launches queued,
    nothing synchronised), in µs. The device is drained before every call, outside the timing, so the
    number is the host's own cost, not a wait for a full launch queue."""
    for _ in range(20):
        fn()
    samples = []
    for _ in range(calls):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[(9 * len(samples)) // 10] / 1e3


def _torch_point(cp, torch, timer, args, p, tw, x, logits, rows, ref, k: int) -> None:
    """The PyTorch baseline of a routed point: its error against the reference and its time, into ``p``."""
    try:
        tx = torch.from_dlpack(x.astype(cp.float32)).to(tw[0].dtype)
        tl = torch.from_dlpack(logits)
        p["torch_err"] = rel_err(torch_moe(torch, tx, tl, *tw, k).float().cpu().numpy()[rows], ref)
        p["torch_us"] = timer.median_us(lambda: torch_moe(torch, tx, tl, *tw, k), args.iters, args.warmup)
    except Exception as exc:
        p["torch_err"] = "ERR " + _reason(exc)
        print(f"  torch baseline: {p['torch_err']}", flush=True)


def bench_layer(cp, torch, timer, ceil, args, shape, dtype, q, rs, emit) -> None:
    """Every token count (and variant) of one (shape, dtype) layer quantized as ``q`` (a
    :class:`~qmoe_rtc.bench.report.LayerQuant`); calls ``emit(point)`` per point."""
    from .._arrays import np_dtype

    bs, float_codes, bits = block_for(shape, args.block_size, q), q.float_codes, q.bits
    variants = variants_for(shape, q, args.variants)
    base = dict(shape=shape.name, H=shape.H, I=shape.I, E=shape.E, k=shape.k, dtype=dtype, format=q.format,
                bits=list(bits), block_size=bs, zero_points=bool(args.zero_points) and not float_codes)
    problem = layout_problem(shape, bs, q)
    try:
        if not problem:
            weights, layers, per_expert, ext_bytes, inputs, refs = prepare_layer(cp, rs, args, shape, dtype, q, bs,
                                                                            variants)
    except Exception as exc:
        if args.verbose:
            traceback.print_exc()
        problem = "layer: " + _reason(exc)
    if problem:
        for T in args.tokens:
            for v in variants:
                emit(dict(base, T=T, variant=v, error=problem))
        return
    if float_codes and shape.has_ext:
        print(f"  [{q.format}: routed layer only]", flush=True)
    tw, terr0 = None, None
    if torch is not None and float_codes:
        print(f"  torch baseline: not run for {q.format} (it runs the same dense dequantized weights as for int "
              "bits)")
    elif torch is not None:
        try:
            tw = torch_weights(cp, torch, weights, shape, dtype, bits, bs)
        except Exception as exc:
            terr0 = "ERR " + _reason(exc)
            print(f"  torch baseline unavailable for this layer: {terr0}", flush=True)
    for T in args.tokens:
        x, logits, _, lh, rows = inputs[T]
        done = {}
        for v in variants:
            moe = layers[v]
            p = dict(base, T=T, variant=v)
            if isinstance(moe, str):
                emit(dict(p, error=moe))
                continue
            p["path"] = moe.path_for(T)
            full = v == "full" and shape.router
            ext = (ext_bytes[v], ext_flops(T, shape, v))
            keep = ~near_tie_rows(lh[rows], shape.k) if full else None
            try:
                _time_point(cp, timer, ceil, args, moe, p, x, None if full else logits, lh, rows, refs[v][T],
                            per_expert, np_dtype(dtype).itemsize, ext, keep)
            except Exception as exc:
                if args.verbose:
                    traceback.print_exc()
                p["error"] = _reason(exc)
            if v == "routed" and tw is not None and not p.get("error"):
                _torch_point(cp, torch, timer, args, p, tw, x, logits, rows, refs[v][T], shape.k)
            elif v == "routed" and terr0:
                p["torch_err"] = terr0
            done[v] = p
            if v == "full" and "routed" in done:
                p["target"] = ext_target(done["routed"].get("graph_us"), p.get("graph_us"), ext_bytes["full"],
                                         ceil.get("copy_GBps"))
            emit(p)


def _environment(cp, torch) -> dict:
    from .. import __version__

    dev = cp.cuda.runtime.getDevice()
    props = cp.cuda.runtime.getDeviceProperties(dev)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    v = lambda n: f"{n // 1000}.{n % 1000 // 10}"  # noqa: E731
    return dict(device=name, sm=f"sm_{props['major']}{props['minor']}", sms=props["multiProcessorCount"],
                mem_GiB=round(props["totalGlobalMem"] / 2**30, 1), driver=v(cp.cuda.runtime.driverGetVersion()),
                runtime=v(cp.cuda.runtime.runtimeGetVersion()), qmoe_rtc=__version__, cupy=cp.__version__,
                torch=None if torch is None else torch.__version__, numpy=np.__version__,
                python=platform.python_version())


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as exc:
        print(f"qmoe_rtc bench: ERR no usable GPU ({_reason(exc)})", file=sys.stderr)
        return 2
    torch = None
    if not args.no_torch:
        try:
            import torch as _torch

            torch = _torch if _torch.cuda.is_available() else None
        except Exception as exc:
            print(f"torch baseline skipped: {_reason(exc)}")
    env = _environment(cp, torch)
    print(f"qmoe_rtc bench on {env['device']} ({env['sm']}, {env['sms']} SMs, {env['mem_GiB']} GiB); driver "
          f"{env['driver']}, runtime {env['runtime']}; qmoe_rtc {env['qmoe_rtc']}, cupy {env['cupy']}, "
          f"torch {env['torch'] or '-'}, python {env['python']}", flush=True)
    timer = Timer(cp)
    ceil = measure_ceilings(cp, timer, torch)
    bw, mm = ceil.get("copy_GBps"), ceil.get("matmul_TFLOPs")
    print("ceilings: copy " + (f"{bw:.0f} GB/s ({COPY_BYTES >> 20} MiB D2D, read+write; memcpy "
                               f"{ceil['copy_memcpy_GBps']:.0f}, kernel {ceil['copy_kernel_GBps']:.0f})" if bw else
                               f"ERR {ceil['copy_error']}") + "; matmul "
          + (f"{mm:.0f} TFLOP/s ({ceil['matmul_source']})" if mm else f"ERR {ceil.get('matmul_error')}"), flush=True)
    print(f"times: median of {args.iters} CUDA-event samples after {args.warmup} warm-up, L2 flushed "
          f"({FLUSH_BYTES >> 20} MiB write) before each; floor = max(bytes/copy, FLOPs/matmul), * = FLOP-bound; "
          f"rel_err = max over graph and eager outputs' check vs float64 reference")
    if any(s.has_ext for s in args.shapes):
        print("shapes with shared experts / router GEMM: name = routed experts only, name/shared = + shared experts "
              "(both with the router GEMM's logits passed), name/full = the whole layer (router_probs None); "
              f"target full <= {EXT_FACTOR}*(routed + (shared + router bytes)/copy)")
    width = label_width(args.shapes, args.variants)
    print(table_header(width), flush=True)
    points, targets, failed = [], [], 0
    conf = {k: v for k, v in vars(args).items() if k not in ("shape", "shapes", "json")}
    conf["shapes"] = [asdict(s) for s in args.shapes]

    def emit(p):
        nonlocal failed
        points.append(p)
        failed += bool(p.get("error")) or not p.get("ok", False)
        print(format_row(p, width), flush=True)
        if p.get("target"):
            targets.append(dict(p["target"], shape=p["shape"], dtype=p["dtype"], format=p["format"], bits=p["bits"],
                                T=p["T"]))
            print(format_target(p["target"]), flush=True)
        if p.get("host_us") is not None:
            print(f"  host time per call: {p['host_us']:.1f} us with out= (p90 {p['host_p90_us']:.1f}), "
                  f"{p['host_alloc_us']:.1f} us allocating the output"
                  + (f", {p['host_torch_us']:.1f} us on torch tensors with out=" if p.get("host_torch_us") else ""),
                  flush=True)
        save()

    def save():
        if args.json:  # rewritten after every point: a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                json.dump(dict(environment=env, ceilings=ceil, config=conf, points=points, targets=targets), f,
                          indent=1, default=str)

    for i, shape in enumerate(args.shapes):
        for dtype in args.dtypes:
            for q in args.layers:
                rs = cp.random.RandomState(args.seed + 1000 * i)
                try:
                    bench_layer(cp, torch, timer, ceil, args, shape, dtype, q, rs, emit)
                finally:
                    cp.get_default_memory_pool().free_all_blocks()
                    if torch is not None:
                        torch.cuda.empty_cache()
            mine = [p for p in points if p["shape"] == shape.name and p["dtype"] == dtype]
            for t in fp8_targets(mine) + decode_targets(mine):
                targets.append(t)
                print(format_target(t), flush=True)
            save()
    verdicts = [{True: "PASS", False: "MISS", None: "not measured"}[t["ok"]] for t in targets]
    summary = "; targets " + ", ".join(f"{verdicts.count(w)} {w}" for w in ("PASS", "MISS", "not measured")
                                       if w in verdicts) if targets else ""
    print(f"{len(points)} points, {failed} failed{summary}" + (f"; numbers in {args.json}" if args.json else ""),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
