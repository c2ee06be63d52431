"""The project's speed targets, from the benchmark's points (GPU-free): the full layer with shared experts
and the router GEMM against the routed layer, FP8 against int8, and decode at 1-8 tokens against the bytes
floor, int2 against int4. Each target is a dict with ``ok`` True
(PASS), False (MISS) or None (not measured in this run); a MISS does not fail the run."""

from __future__ import annotations

from ..formats.axis import FP8_E4M3, INT
from .report import BENCH_SHAPES

__all__ = ["DECODE_PCT", "DECODE_T", "EXT_FACTOR", "INT2_FACTOR", "decode_targets", "ext_target", "format_target",
           "fp8_targets"]

#: The issue's target for the full layer: full_us <= EXT_FACTOR * (routed_us + extension bytes / copy rate).
EXT_FACTOR = 1.15
#: FP8 targets: decode at FP8_DECODE_T tokens >= FP8_DECODE_SHARE of int8's %floor; prefill at
#: FP8_PREFILL_T tokens <= FP8_PREFILL_FACTOR x int8's time (same shape, dtype and run).
FP8_DECODE_T, FP8_DECODE_SHARE, FP8_PREFILL_T, FP8_PREFILL_FACTOR = 1, 0.8, 4096, 1.2
#: Decode targets: % of the bytes floor at DECODE_T tokens, int4 at the shape's block size.
DECODE_PCT = {"mixtral-8x7b": 60.0, "gpt-oss-120b": 45.0, "qwen3-30b-a3b": 35.0, "ort-2048": 35.0}
DECODE_T = (1, 2, 4, 8)
#: int2 at 1 token <= INT2_FACTOR x int4's time, on these shapes.
INT2_FACTOR, INT2_SHAPES = 0.65, ("mixtral-8x7b", "gpt-oss-120b")


def ext_target(routed_us: float, full_us: float, ext_bytes: int, copy_GBps: float | None,
               factor: float = EXT_FACTOR) -> dict:
    """full_us <= factor·(routed_us + ext_bytes / copy rate): the bound, full/bound and PASS (ok)."""
    extra = ext_bytes / (copy_GBps * 1e3) if copy_GBps else None
    if extra is None or not routed_us or full_us is None:
        return dict(kind="ext", ok=None, reason="needs the routed and full times and the copy rate")
    bound = factor * (routed_us + extra)
    return dict(kind="ext", routed_us=routed_us, full_us=full_us, ext_bytes=ext_bytes, ext_us=extra,
                bound_us=bound, ratio=full_us / bound, ok=full_us <= bound)


def _format_of(p: dict) -> str:
    """A point's weight format ('int' for points written before the bench had --format)."""
    return p.get("format", INT.name)


def _pick(points, T: int, fp8: bool, block_size=None):
    for p in points:
        is_fp8 = _format_of(p) == FP8_E4M3.name
        if (p["T"] == T and is_fp8 == fp8 and (fp8 or (_format_of(p) == INT.name and tuple(p["bits"]) == (8, 8)))
                and p.get("variant", "routed") == "routed" and not p.get("error") and p.get("graph_us")
                and (block_size is None or p["block_size"] == block_size)):
            return p
    return None


def fp8_targets(points) -> list[dict]:
    """The FP8 targets of one (shape, dtype) from its points, per FP8 scale form measured: decode at
    FP8_DECODE_T tokens (FP8 %floor >= FP8_DECODE_SHARE of int8's) and prefill at FP8_PREFILL_T
    (FP8 time <= FP8_PREFILL_FACTOR x int8's); ok None where a point is missing."""
    out = []
    forms = sorted({p["block_size"] for p in points if _format_of(p) == FP8_E4M3.name})
    for bs in forms:
        base = dict(shape=points[0]["shape"], dtype=points[0]["dtype"], scales=f"block {bs}" if bs else "global",
                    block_size=bs)
        f, i = _pick(points, FP8_DECODE_T, True, bs), _pick(points, FP8_DECODE_T, False)
        t = dict(base, kind="fp8_decode", T=FP8_DECODE_T, want=FP8_DECODE_SHARE, ok=None)
        if f and i and f.get("pct_floor") and i.get("pct_floor"):
            t.update(fp8=f["pct_floor"], int8=i["pct_floor"], ratio=f["pct_floor"] / i["pct_floor"])
            t["ok"] = t["ratio"] >= FP8_DECODE_SHARE
        out.append(t)
        f, i = _pick(points, FP8_PREFILL_T, True, bs), _pick(points, FP8_PREFILL_T, False)
        t = dict(base, kind="fp8_prefill", T=FP8_PREFILL_T, want=FP8_PREFILL_FACTOR, ok=None)
        if f and i:
            t.update(fp8=f["graph_us"], int8=i["graph_us"], ratio=f["graph_us"] / i["graph_us"])
            t["ok"] = t["ratio"] <= FP8_PREFILL_FACTOR
        out.append(t)
    return out


def _verdict(ok) -> str:
    return "not measured" if ok is None else "PASS" if ok else "MISS"


def format_target(t: dict) -> str:
    """One summary line of a target dict from :func:`ext_target`, :func:`fp8_targets` or :func:`decode_targets`."""
    if t["kind"] in ("decode", "int2"):
        return _format_decode(t)
    if t["kind"] == "ext":
        if t["ok"] is None:
            return f"  target full <= {EXT_FACTOR}*(routed + ext bytes/copy): not measured ({t.get('reason')})"
        return (f"  target full <= {EXT_FACTOR}*(routed + ext bytes/copy): {t['full_us']:.1f} <= {EXT_FACTOR}*"
                f"({t['routed_us']:.1f} + {t['ext_us']:.1f} for {t['ext_bytes'] / 1e6:.2f} MB) = {t['bound_us']:.1f} "
                f"us: ratio {t['ratio']:.3f} {_verdict(t['ok'])}")
    head = f"fp8 target {t['shape']} {t['dtype']} fp8 {t['scales']}: "
    if t["kind"] == "fp8_decode":
        what = f"decode T={t['T']} %floor fp8 >= {t['want']:.0%} of int8"
        nums = f"{t['fp8']:.1f} vs {t['int8']:.1f} = {t['ratio']:.0%} " if t["ok"] is not None else ""
    else:
        what = f"prefill T={t['T']} time fp8 <= {t['want']}x int8"
        nums = f"{t['fp8']:.1f} vs {t['int8']:.1f} us = {t['ratio']:.2f}x " if t["ok"] is not None else ""
    need = "" if t["ok"] is not None else (f" (needs --format int,fp8_e4m3 with --bits 8 and the fp8 form at --tokens "
                                           f"{t['T']})")
    return f"{head}{what}: {nums}{_verdict(t['ok'])}{need}"


def _routed(points, T: int, bits: tuple, block_size: int):
    for p in points:
        if (p["T"] == T and _format_of(p) == INT.name and tuple(p["bits"]) == bits and not p.get("error")
                and p.get("variant", "routed") == "routed" and p.get("graph_us") and p["block_size"] == block_size):
            return p
    return None


def decode_targets(points) -> list[dict]:
    """The decode targets of one (shape, dtype) from its points: int4 (the shape's block size) at each of
    DECODE_T tokens >= DECODE_PCT % of the bytes floor, and on INT2_SHAPES int2 at 1 token <= INT2_FACTOR
    x int4. Only the points this run measured give targets (none for other shapes)."""
    if not points or points[0]["shape"] not in DECODE_PCT:
        return []
    name, dtype = points[0]["shape"], points[0]["dtype"]
    want, bs = DECODE_PCT[name], BENCH_SHAPES[name].block_size
    out = []
    for T in DECODE_T:
        p = _routed(points, T, (4, 4), bs)
        if p is not None and p.get("pct_floor"):
            out.append(dict(kind="decode", shape=name, dtype=dtype, T=T, want=want, us=p["graph_us"],
                            pct=p["pct_floor"], ok=p["pct_floor"] >= want))
    i2, i4 = _routed(points, 1, (2, 2), bs), _routed(points, 1, (4, 4), bs)
    if name in INT2_SHAPES and i2 is not None and i4 is not None:
        ratio = i2["graph_us"] / i4["graph_us"]
        out.append(dict(kind="int2", shape=name, dtype=dtype, T=1, want=INT2_FACTOR, int2=i2["graph_us"],
                        int4=i4["graph_us"], ratio=ratio, ok=ratio <= INT2_FACTOR))
    return out


def _format_decode(t: dict) -> str:
    head = f"decode target {t['shape']} {t['dtype']} T={t['T']}: "
    if t["kind"] == "decode":
        return f"{head}int4 {t['us']:.1f} us = {t['pct']:.1f} % of the bytes floor (>= {t['want']:.0f} %) {_verdict(t['ok'])}"
    return (f"{head}int2 {t['int2']:.1f} us vs int4 {t['int4']:.1f} us = {t['ratio']:.2f}x (<= {t['want']}x) "
            f"{_verdict(t['ok'])}")
