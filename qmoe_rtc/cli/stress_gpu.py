"""The GPU side of the contention stress check (:mod:`qmoe_rtc.cli.stress`): one worker process.

A worker draws layers from :data:`qmoe_rtc.cli.stress.LAYOUTS` with its own seed, forces one engine per
layer (decode / prefill path, mma.sync or wgmma prefill) and, per row count, does what a serving loop
does with a captured forward: capture on its own arrays, then twice write fresh inputs, replay the
graph, call the layer eagerly with ``out=``, and compare

- replay against eager, bitwise (the difference the check exists for),
- both against the float64 reference (:func:`qmoe_rtc.contract.reference.qmoe`) on sampled rows, and every
  output element of both for having been written (none left at the poison, a NaN).

Before each forward the output is poisoned with 0xFF, every scratch buffer a kernel writes before it
reads with a different byte for replay and for eager (a read of a stale scratch byte then shows up as
a replay / eager difference), and every SM's shared memory with a third byte (a kernel that reads
shared memory it did not write sees garbage that changes from forward to forward).
"""

from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

from ..bench.report import TOL, rel_err  # the contract's accuracy per dtype, the relative error it is judged by

__all__ = ["build_layer", "engine_scope", "ran_engine", "run_worker"]

#: Bytes poisoned into (output, replay scratch, eager scratch); shared memory gets a fresh byte each forward.
OUT_POISON, SCRATCH_POISON = 0xFF, (0xA5, 0x5A)
REF_ROWS = 48  # rows per check compared with the float64 reference (drawn at random)
SHOW = 6  # differing elements described per failure

_SMEM_SRC = r"""
extern "C" __global__ void qmoe_stress_smem(unsigned int word, int words) {
  extern __shared__ unsigned int s[];
  volatile unsigned int* p = s;
  for (int i = threadIdx.x; i < words; i += blockDim.x) p[i] = word;
}
"""


class SmemPoison:
    """Fills every SM's shared memory (all a block may take) with one byte, on the current stream."""

    def __init__(self, cp):
        rt, dev = cp.cuda.runtime, cp.cuda.Device().id
        self.nbytes = int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))
        self.sms = int(rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, dev))
        self.kernel = cp.RawKernel(_SMEM_SRC, "qmoe_stress_smem")
        self.kernel.max_dynamic_shared_size_bytes = self.nbytes

    def __call__(self, byte: int) -> None:
        word = np.uint32(byte * 0x01010101)
        self.kernel((2 * self.sms,), (1024,), (word, np.int32(self.nbytes // 4)), shared_mem=self.nbytes)


class CupyArrays:
    """The worker's arrays as CuPy arrays, the graph from :meth:`QMoE.capture`."""

    def __init__(self, cp):
        self.cp = cp

    def dev(self, a):
        return self.cp.asarray(a)

    def host(self, a):
        return a.get()

    def empty_like(self, a):
        return self.cp.empty_like(a)

    def poison(self, a, byte: int) -> None:
        a.view(self.cp.uint8).fill(byte)

    def write(self, dst, src) -> None:
        dst[...] = self.cp.asarray(src)

    def capture(self, moe, x, lg, out):
        return moe.capture(x, lg, out=out).replay

    def sync(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()


class TorchArrays(CupyArrays):
    """The worker's arrays as torch CUDA tensors, the graph recorded by ``torch.cuda.graph`` around the
    layer call (as a serving engine captures a whole model): one eager call first, then the capture."""

    def __init__(self, cp):
        import torch

        super().__init__(cp)
        self.torch = torch

    def dev(self, a):
        t = self.torch
        a = np.ascontiguousarray(a)
        bits = {"bfloat16": (np.int16, t.bfloat16), "float8_e4m3fn": (np.uint8, t.float8_e4m3fn)}.get(a.dtype.name)
        if bits:  # torch reads no ml_dtypes arrays: their bits, then a view
            return t.from_numpy(a.view(bits[0])).cuda().view(bits[1])
        return t.from_numpy(a).cuda()

    def host(self, a):
        if a.dtype == self.torch.bfloat16:
            import ml_dtypes

            return a.view(self.torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return a.cpu().numpy()

    def empty_like(self, a):
        return self.torch.empty_like(a)

    def poison(self, a, byte: int) -> None:
        a.view(self.torch.uint8).fill_(byte)

    def write(self, dst, src) -> None:
        dst.copy_(self.dev(src))

    def capture(self, moe, x, lg, out):
        t = self.torch
        moe(x, lg, out=out)
        g = t.cuda.CUDAGraph()
        with t.cuda.graph(g):
            moe(x, lg, out=out)
        return g.replay

    def sync(self) -> None:
        self.torch.cuda.synchronize()


def _written_scratch(moe) -> list:
    """The layer's scratch buffers a forward writes before reading ((name, array) pairs): every buffer
    except the zeroed ones, which kernels return to zero themselves (counters)."""
    zeroed = {n for p in moe._plans.values() for n, s in p.needs.items() if s.zero}
    return [(n, b) for pool in moe._pools.values() for n, b in pool.bufs.items() if n not in zeroed]


def _snapshot(moe) -> dict:
    return {n: b.get() for n, b in _written_scratch(moe)}


def _stage_report(a: dict, b: dict, R: int) -> dict:
    """Which scratch buffers differ between two forwards (replay ``a``, eager ``b``): bytes differing per
    buffer, and for the grouped (prefill) path the FC1 / FC2 rows compared route by route."""
    rep = {n: int((a[n] != b[n]).sum()) for n in a if n in b}
    if "sorted" in a and "act_sorted" in a:
        sa, sb = a["sorted"].view(np.int32)[:R], b["sorted"].view(np.int32)[:R]
        rep["positions_same"] = bool((sa == sb).all())
        acts = [x["act_sorted"].view(np.uint16) for x in (a, b)]
        width = acts[0].size // max(R, 1)
        if width and sa.min() >= 0 and sb.min() >= 0:
            ra = np.empty((R, width), np.uint16)
            rb = np.empty((R, width), np.uint16)
            ra[sa] = acts[0][: R * width].reshape(R, width)
            rb[sb] = acts[1][: R * width].reshape(R, width)
            rep["act_routes_differ"] = int((ra != rb).any(axis=1).sum())
    if "y" in a:
        ya, yb = (x["y"].view(np.uint32) for x in (a, b))
        n = min(ya.size, yb.size)
        rep["y_elems_differ"] = int((ya[:n] != yb[:n]).sum())
    return rep


def _describe(og, oe, ref_rows, ref, limit=SHOW) -> list:
    """The first differing elements: (row, col, replay, eager, reference or None)."""
    rows, cols = np.nonzero(og.view(np.uint16 if og.itemsize == 2 else np.uint32) !=
                            oe.view(np.uint16 if oe.itemsize == 2 else np.uint32))
    where = {int(r): i for i, r in enumerate(ref_rows)}
    out = []
    for r, c in zip(rows[:limit], cols[:limit]):
        rv = float(ref[where[int(r)], c]) if int(r) in where else None
        out.append((int(r), int(c), float(og[r, c]), float(oe[r, c]), rv))
    return out


class Stats:
    """Counts per engine: layer-runs, replay / eager differences, reference failures, worst error."""

    def __init__(self):
        self.by_engine: dict = {}

    def add(self, engine: str, diff: bool, ref_bad: bool, err: float) -> None:
        s = self.by_engine.setdefault(engine, {"runs": 0, "diff": 0, "ref_fail": 0, "worst": 0.0})
        s["runs"] += 1
        s["diff"] += int(diff)
        s["ref_fail"] += int(ref_bad)
        s["worst"] = max(s["worst"], err if math.isfinite(err) else 1e30)


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _forward_pair(arr, moe, replay, x, lg, og, oe, smem, diagnose):
    """Replay then eager on the current inputs, each with fresh poison; (scratch after replay, after eager)."""
    snaps = []
    for i, out in enumerate((og, oe)):
        arr.poison(out, OUT_POISON)
        for _, buf in _written_scratch(moe):
            buf.fill(SCRATCH_POISON[i])
        if smem is not None:
            smem(int(np.random.randint(1, 255)))
        if i == 0:
            replay()
        else:
            moe(x, lg, out=oe)
        if diagnose:
            snaps.append(_snapshot(moe))
    arr.sync()
    return snaps


def engine_scope(engine: str):
    """The knob scope that makes the prefill path run ``engine`` ('prefill-batched' / 'prefill-mma' /
    'prefill-wgmma')."""
    from ..settings import knobs

    path, _, kind = engine.partition("-")
    return knobs.scope(prefill_engine=kind if path == "prefill" and kind in ("batched", "mma", "wgmma") else "auto")


def ran_engine(moe, rows: int, dtype: str) -> str:
    """The engine a call of ``moe`` runs, as :data:`qmoe_rtc.cli.stress.ENGINES` names it: the pipeline (call inside
    :func:`engine_scope`)."""
    return moe.engine_for(rows, dtype).pipeline.name


def build_layer(cp, rng, case, dev=None):
    """A fresh random layer of ``case`` = (layout, engine) on the GPU, on the engine's path; call it (and
    plan it) inside :func:`engine_scope`. ``dev`` puts a host array on the GPU (default: CuPy).
    Returns (layer, host weights, attributes)."""
    from ..contract.random_layer import random_layer
    from ..executor import QMoE

    (name, kw, E, H, I, dtype), engine = case
    kw = dict(kw)
    k = kw.pop("k")
    w, a = random_layer(rng, E=E, H=H, I=I, k=k, dtype=dtype, **kw)
    with engine_scope(engine):
        moe = QMoE(**{n: (dev or cp.asarray)(v) for n, v in w.items()}, **a,
                   decode_max_routes=512 if engine.startswith("decode") else 0)
    return moe, w, a


def check_layer(arr, rng, case, rows_list, stats: Stats, opts) -> None:
    """Build one random layer of ``case`` on its forced engine and check it at each row count (``arr``:
    the array kind, :class:`CupyArrays` or :class:`TorchArrays`)."""
    from ..contract.random_layer import random_inputs
    from ..contract.reference import qmoe as reference

    (name, kw, E, H, I, dtype), engine = case
    moe, w, a = build_layer(arr.cp, rng, case, arr.dev)
    router_gemm = "router_weight" in w
    slots = kw["k"] + int(kw.get("shared", 0))
    with engine_scope(engine):
        for rows in rows_list:
            ran = ran_engine(moe, rows, dtype)
            x0, l0, _ = random_inputs(rng, rows, H, E, dtype)
            x, lg = arr.dev(x0), None if router_gemm else arr.dev(l0)
            og, oe = arr.empty_like(x), arr.empty_like(x)
            replay = arr.capture(moe, x, lg, og)
            for _ in range(opts.inputs):
                xn, ln, _ = random_inputs(rng, rows, H, E, dtype)
                arr.write(x, xn)
                if lg is not None:
                    arr.write(lg, ln)
                snaps = _forward_pair(arr, moe, replay, x, lg, og, oe, opts.smem, opts.diagnose)
                hg, he = arr.host(og), arr.host(oe)
                diff = hg.view(np.uint8).tobytes() != he.view(np.uint8).tobytes()
                sel = np.sort(rng.choice(rows, min(rows, REF_ROWS), replace=False))
                ref = reference(xn[sel], None if router_gemm else ln[sel], **w, **a)
                err = max(rel_err(hg[sel], ref), rel_err(he[sel], ref))
                unwritten = int(np.isnan(hg.astype(np.float32)).sum() + np.isnan(he.astype(np.float32)).sum())
                bad = not err <= TOL[dtype] or unwritten > 0
                stats.add(ran, diff, bad, err)
                if diff or bad:
                    rec = dict(event="failure", layout=name, engine=ran, rows=rows, diff=diff, ref_err=err,
                               unwritten=unwritten,
                               tol=TOL[dtype], elems_differ=int((hg.view(np.uint8) != he.view(np.uint8)).sum()),
                               first=_describe(hg, he, sel, ref) if diff else [])
                    if snaps:
                        rec["stages"] = _stage_report(snaps[0], snaps[1], rows * slots)
                    _emit(rec)
            del replay


def run_worker(opts) -> int:
    """One stress worker: random layers until ``opts.seconds`` have passed (or ``opts.layers`` layers are
    checked), the engines in turn (worker i starts at engine i), a random layout of each; prints JSON
    lines (failures as they happen, then a summary with the per-engine counts). ``opts.rows_of``: the row counts
    each case draws from, by (layout name, engine) (:func:`qmoe_rtc.cli.stress.rows_for`)."""
    import cupy as cp

    rng = np.random.default_rng(opts.seed)
    np.random.seed(opts.seed % (2**32))
    arr = TorchArrays(cp) if opts.torch else CupyArrays(cp)
    opts.smem = SmemPoison(cp) if opts.poison_smem else None
    by_engine: dict = {}
    for case in opts.cases:
        by_engine.setdefault(case[1], []).append(case)
    engines = sorted(by_engine)
    stats = Stats()
    t_end = time.monotonic() + opts.seconds
    i, done, errors = opts.index, 0, 0
    while time.monotonic() < t_end and (not opts.layers or done < opts.layers):
        pool = by_engine[engines[i % len(engines)]]
        case = pool[int(rng.integers(len(pool)))]
        i, done = i + 1, done + 1
        rows_list = [int(r) for r in rng.choice(opts.rows_of[case[0][0], case[1]], size=opts.rows_per_layer)]
        try:
            check_layer(arr, rng, case, rows_list, stats, opts)
        except Exception as exc:  # reported and counted: a crash is a failure of the check too
            errors += 1
            _emit(dict(event="error", layout=case[0][0], engine=case[1], error=f"{type(exc).__name__}: {exc}"))
    _emit(dict(event="summary", seed=opts.seed, engines=stats.by_engine, errors=errors))
    return 0
