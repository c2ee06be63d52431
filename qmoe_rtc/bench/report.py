"""The GPU-free half of the benchmark (:mod:`qmoe_rtc.bench.run`): shapes, arguments, floors and the table
(the issues' targets are in :mod:`qmoe_rtc.bench.targets`)."""

from __future__ import annotations

import argparse
import math
import traceback
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import QMoEAttributeError
from ..formats.axis import FORMATS, INT, WeightFormat, weight_format

__all__ = ["BENCH_SHAPES", "DEFAULT_PRESETS", "DEFAULT_TOKENS", "TOL", "VARIANTS", "LayerQuant", "Shape",
           "block_for", "build_parser", "check_rows", "codes_label", "expert_bytes", "ext_flops", "extension_bytes",
           "floor_bytes", "flop_count", "format_row", "label_width", "layout_problem", "near_tie_rows", "parse_args",
           "parse_bits", "parse_formats", "parse_shape", "rel_err", "row_label", "table_header", "top_k_experts",
           "variants_for"]

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}  # docs/contract.md, "Accuracy"
DEFAULT_PRESETS = "qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b,ort-2048"
DEFAULT_TOKENS = "1,2,4,8,16,32,64"
#: Layers timed per point of a shape with [ext] parts: routed experts only (logits passed), + the shared
#: experts (logits passed), the full layer (shared experts + router GEMM, router_probs None).
VARIANTS = ("routed", "shared", "full")
#: --bits spellings of formats before --format existed, refused naming the new spelling.
_OLD_BITS = {"fp8": "--format fp8_e4m3", "fp8g": "--format fp8_e4m3:0", "mxfp4": "--format mxfp4",
             "nvfp4": "--format nvfp4"}


class LayerQuant(NamedTuple):
    """How one benchmarked layer is quantized: its weight format (:mod:`qmoe_rtc.formats`), the code widths of
    FC1 and FC2 (a float format's own) and its block size (None: the shape's; FP4: the format's)."""

    format: str
    bits: tuple
    block_size: int | None = None

    @property
    def fmt(self) -> WeightFormat:
        return weight_format(self.format)

    @property
    def float_codes(self) -> bool:
        """A float format (FP8, FP4): no zero points, routed layers only, no torch baseline."""
        return self.fmt is not INT


@dataclass(frozen=True)
class Shape:
    name: str
    H: int
    I: int  # noqa: E741
    E: int
    k: int
    block_size: int = 128  # default when --block-size is not given
    shared: int = 0  # [ext] shared experts, intermediate size I
    shared_gate: bool = False  # [ext] their sum scaled by sigmoid(x·g)
    router: bool = False  # [ext] router GEMM in the layer: router_weight [E, H] in the activation dtype

    @property
    def has_ext(self) -> bool:
        return bool(self.shared or self.router)


BENCH_SHAPES = {s.name: s for s in (
    Shape("qwen3-30b-a3b", 2048, 768, 128, 8),
    Shape("mixtral-8x7b", 4096, 14336, 8, 2),  # as fused swiglu: FC1 [8, 28672, 4096]
    Shape("gpt-oss-120b", 2880, 2880, 128, 4, block_size=32),
    Shape("ort-2048", 2048, 2048, 8, 2),
    Shape("deepseek-v3-tp8", 7168, 2048 // 8, 256, 8, shared=1, router=True),
    Shape("qwen3-next-80b-a3b", 2048, 512, 512, 10, shared=1, shared_gate=True, router=True),
)}


# -- arguments (GPU-free) --------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def parse_shape(text: str) -> Shape:
    """``H,I,E,k`` → a custom Shape named ``HxIxExk``."""
    try:
        H, I, E, k = _ints(text)  # noqa: E741
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape wants H,I,E,k (four integers), got {text!r}") from None
    if min(H, I, E, k) < 1 or k > E:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: sizes must be >= 1 and k <= E")
    return Shape(f"{H}x{I}x{E}x{k}", H, I, E, k)


def parse_bits(text: str) -> tuple:
    """``4`` → (4, 4); ``4,2`` → (fc1 4, fc2 2): integer code widths. A format name there (the spelling before
    ``--format``) is refused, naming the option that now says it."""
    from ..formats.quantize import SUPPORTED_BITS

    if text.strip() in _OLD_BITS:
        raise argparse.ArgumentTypeError(f"--bits {text.strip()}: --bits takes integer code widths; the weight format "
                                         f"is {_OLD_BITS[text.strip()]}")
    try:
        b = _ints(text)
    except ValueError:
        b = []
    if len(b) not in (1, 2) or any(x not in SUPPORTED_BITS for x in b):
        raise argparse.ArgumentTypeError(f"--bits wants b or fc1,fc2 with b in {SUPPORTED_BITS}; got {text!r} (weight "
                                         f"formats: --format {','.join(FORMATS)})")
    return (b[0], b[-1])


def parse_formats(text: str) -> list[tuple[WeightFormat, int | None]]:
    """``FMT[:BS][,FMT[:BS]...]`` → [(format, block size or None)]: weight formats by their names (typed errors
    naming ``--format``), each with its own block size where given (``fp8_e4m3:0``: one scale per expert)."""
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        name, _, bs = item.partition(":")
        fmt = weight_format(name, "--format")
        try:
            block = int(bs) if bs else None
        except ValueError:
            raise QMoEAttributeError("--format", "FMT or FMT:BS with BS an integer block size", repr(item)) from None
        out.append((fmt, None if block is None else fmt.check_block_size(block, f"--format {item}")))
    return out


def build_parser() -> argparse.ArgumentParser:
    ext = lambda s: (f", {s.shared} shared" + (" gated" if s.shared_gate else "") if s.shared else "") + (  # noqa: E731
        ", router GEMM" if s.router else "")
    shapes = ", ".join(f"{s.name} (H {s.H}, I {s.I}, E {s.E}, k {s.k}{ext(s)})" for s in BENCH_SHAPES.values())
    p = argparse.ArgumentParser(
        prog="python -m qmoe_rtc bench run", epilog=f"bench shapes: {shapes}",
        description="Time CUDA-graph replay, eager calls and a PyTorch baseline of random quantized MoE layers; check "
                    "every point against the CPU reference; report % of the floor measured in the same run (the "
                    "module docstring of qmoe_rtc/bench/run.py says how).")
    p.add_argument("--preset", "--shapes", dest="preset",
                   help=f"comma list of bench shapes, or 'all' (default {DEFAULT_PRESETS}; none when only --shape is "
                        "given)")
    p.add_argument("--shape", type=parse_shape, action="append", default=[], help="custom H,I,E,k (repeatable)")
    p.add_argument("--tokens", type=_ints, default=_ints(DEFAULT_TOKENS), help=f"comma list (default {DEFAULT_TOKENS})")
    p.add_argument("--format", default="int",
                   help=f"comma list of weight formats, from {', '.join(FORMATS)} (default int), each as FMT or FMT:BS "
                        "with its own block size. fp8_e4m3: FP8 e4m3 experts with float32 block scales of the block "
                        "size (fp8_e4m3:0, or --block-size 0: one global scale per expert). With int at --bits 8 and "
                        "fp8_e4m3 at --tokens 1 and 4096 the FP8 targets are reported. mxfp4 / nvfp4: FP4 (e2m1) "
                        "experts, their block of 32 / 16 (the floor counts the format's bytes: e8m0 / e4m3 scales). "
                        "The old --bits fp8 / fp8g / mxfp4 / nvfp4 are refused, naming these")
    p.add_argument("--bits", type=parse_bits, action="append",
                   help="integer code widths of --format int: b, or fc1,fc2 (repeatable; default 4)")
    p.add_argument("--block-size", type=int, help="0 (row-wise) or a power of two >= 16 (default 128, gpt-oss 32)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="for shapes with shared experts or a router GEMM, the layers timed per point: routed "
                        "(routed experts only, logits passed), shared (+ shared experts, logits passed), full "
                        "(+ router GEMM, router_probs None); comma list (default all; the target needs routed,full)")
    p.add_argument("--dtype", default="float16", help="comma list of float16,bfloat16,float32 (default float16)")
    p.add_argument("--zero-points", action="store_true", help="asymmetric quantization with zero-point tensors")
    p.add_argument("--iters", type=int, default=100, help="timed samples per measurement, >= 50 (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls first (default 10)")
    p.add_argument("--check-rows", type=int, default=256, help="rows checked against the CPU reference per point "
                                                               "(evenly spaced when T is larger; default 256)")
    p.add_argument("--json", metavar="PATH", help="write every number and the environment as JSON")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--no-eager", action="store_true", help="skip the eager timing")
    p.add_argument("--host", action="store_true", help="also time the host side of an eager call (CPU time from "
                                                       "entering the call to its return, launches queued, no sync)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-max-routes", type=int, default=None,
                   help="override QMoE's decode/prefill switch (rows*k up to this take the decode path)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing points to stderr")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate; adds ``shapes`` (list of Shape), ``dtypes`` and ``layers`` (a :class:`LayerQuant` per
    layer: every --bits of int, one layer per float format); ``bits`` is a list of pairs."""
    p = build_parser()
    a = p.parse_args(argv)
    names = a.preset if a.preset is not None else ("" if a.shape else DEFAULT_PRESETS)
    names = list(BENCH_SHAPES) if names.strip() == "all" else [n.strip() for n in names.split(",") if n.strip()]
    for n in names:
        if n not in BENCH_SHAPES:
            p.error(f"--preset: unknown {n!r}; known: {', '.join(BENCH_SHAPES)}")
    a.shapes = [BENCH_SHAPES[n] for n in names] + list(a.shape)
    if not a.shapes:
        p.error("nothing to run: give --preset or --shape")
    a.dtypes = [d.strip() for d in a.dtype.split(",") if d.strip()]
    for d in a.dtypes:
        if d not in TOL:
            p.error(f"--dtype: {d!r} is not one of {', '.join(TOL)}")
    a.bits = a.bits or [(4, 4)]
    try:
        formats = parse_formats(a.format)
    except QMoEAttributeError as exc:  # a WeightFormatError names the format names
        p.error(str(exc))
    if not formats:
        p.error("--format: at least one weight format")
    a.layers = list(dict.fromkeys(LayerQuant(f.name, bits, bs) for f, bs in formats
                                  for bits in (a.bits if f is INT else [(f.bits[0],) * 2])))
    a.variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not a.variants or any(v not in VARIANTS for v in a.variants):
        p.error(f"--variants: a comma list of {', '.join(VARIANTS)}, got {','.join(a.variants) or repr('')}")
    if not a.tokens or min(a.tokens) < 1:
        p.error("--tokens: positive integers")
    bs = a.block_size
    if bs is not None and bs != 0 and (bs < 16 or bs & (bs - 1)):
        p.error(f"--block-size: 0 or a power of two >= 16, got {bs}")
    if a.iters < 50:
        p.error(f"--iters: at least 50 (a median of fewer samples is noise), got {a.iters}")
    if a.warmup < 0 or a.check_rows < 1:
        p.error("--warmup >= 0 and --check-rows >= 1")
    return a


def block_for(shape: Shape, block_size, q: LayerQuant | None = None) -> int:
    """The block size of a layer: its format's own (FP4), else the layer's (``--format FMT:BS``), else
    --block-size, else the shape's."""
    if q is not None and q.fmt.scale.block:
        return q.fmt.scale.block
    if q is not None and q.block_size is not None:
        return q.block_size
    return shape.block_size if block_size is None else int(block_size)


def variants_for(shape: Shape, q: LayerQuant, wanted) -> list[str]:
    """The layers timed for ``shape``: 'routed' alone without [ext] parts or with a float format (the FP8
    targets compare routed layers with int8), else the wanted ones it has (no 'shared' without shared
    experts)."""
    if not shape.has_ext or q.float_codes:
        return ["routed"]
    return [v for v in VARIANTS if v in wanted and (v != "shared" or (shape.shared and shape.router))]


def layout_problem(shape: Shape, block_size: int, q: LayerQuant | None = None) -> str | None:
    """Why this block size cannot quantize this shape (None if it can; square FP8 blocks may be partial)."""
    if q is not None and q.fmt.scale.square:
        return None
    for name, K in (("H", shape.H), ("I", shape.I)):
        if block_size and K % block_size:
            return f"block_size {block_size} does not divide {name}={K} (give --block-size 0 or one dividing H and I)"
    return None


# -- floors (GPU-free) -----------------------------------------------------------------------------
def top_k_experts(logits, k: int) -> np.ndarray:
    """Experts chosen per row [T, k]: softmax top-k = top-k of the logits, ties to the lower index."""
    lg = np.asarray(logits, dtype=np.float32)
    return np.argsort(-lg, axis=-1, kind="stable")[:, :k]


def _proj_bytes(N: int, K: int, bits, block_size: int, zero_points: bool, scale_itemsize: int,
                fmt: WeightFormat = INT) -> int:
    packed = N * ((K * bits + 7) // 8)  # every format packs its codes along K
    if fmt.scale.square:  # FP8: float32 scales, square blocks or one per expert
        nbn, nbk = (-(-N // block_size), -(-K // block_size)) if block_size else (1, 1)
        return packed + nbn * nbk * 4
    if fmt.scale.block:  # the format's scale bytes, one per block of its own (+ a float32 global scale per expert)
        return packed + N * (K // fmt.scale.block) + (4 if fmt.scale.global_scale else 0)
    nb = K // block_size if block_size else 1
    scales = N * nb * scale_itemsize
    zp = 0
    if zero_points:  # block-wise: packed along blocks per row; row-wise: packed along N
        zp = N * ((nb * bits + 7) // 8) if block_size else (N * bits + 7) // 8
    return packed + scales + zp


def expert_bytes(H: int, I: int, bits, block_size: int, zero_points: bool, scale_itemsize: int,  # noqa: E741
                 format: str = "int") -> int:
    """Bytes of one expert: fused FC1 [2I, H] + FC2 [H, I], packed codes + scales + zero points (a float
    ``format``: its codes and scale bytes, ``scale_itemsize`` unused)."""
    b1, b2 = bits
    fmt = weight_format(format)
    return (_proj_bytes(2 * I, H, b1, block_size, zero_points, scale_itemsize, fmt)
            + _proj_bytes(H, I, b2, block_size, zero_points, scale_itemsize, fmt))


def floor_bytes(logits, k: int, H: int, per_expert: int, act_itemsize: int) -> tuple[int, int]:
    """(bytes, unique experts): the selected experts' weights + input + output + float32 logits."""
    lg = np.asarray(logits)
    T, E = lg.shape
    unique = int(np.unique(top_k_experts(lg, k)).size)
    return unique * per_expert + 2 * T * H * act_itemsize + T * E * 4, unique


def flop_count(T: int, k: int, H: int, I: int) -> int:  # noqa: E741
    return 2 * T * k * (H * 2 * I + I * H)


def extension_bytes(shape: Shape, bits, block_size: int, zero_points: bool, scale_itemsize: int,
                    act_itemsize: int, format: str = "int") -> tuple[int, int]:
    """(shared bytes, router bytes) a forward reads beyond the routed experts: every shared expert
    (the routed layout) + the gate weight [H]; the router weight [E, H] (all in the activation dtype)."""
    shared = shape.shared * expert_bytes(shape.H, shape.I, bits, block_size, zero_points, scale_itemsize, format)
    shared += shape.H * act_itemsize if shape.shared_gate else 0
    return shared, (shape.E * shape.H * act_itemsize if shape.router else 0)


def ext_flops(T: int, shape: Shape, variant: str) -> int:
    """FLOPs the variant adds to the routed ones: S more routes per token, the router GEMM [T, H]·[H, E]."""
    f = flop_count(T, shape.shared, shape.H, shape.I) if variant in ("shared", "full") else 0
    return f + (2 * T * shape.E * shape.H if variant == "full" and shape.router else 0)


def near_tie_rows(logits, k: int, eps: float = 1e-3) -> np.ndarray:
    """bool [T]: rows whose k-th and (k+1)-th largest logits are within eps·max(1, max |logit|); the
    router GEMM's float32 logits may choose differently from the float64 reference there."""
    lg = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)[:, ::-1]
    if k >= lg.shape[1]:
        return np.zeros(lg.shape[0], dtype=bool)
    scale = np.maximum(1.0, np.abs(lg).max(axis=-1))
    return (lg[:, k - 1] - lg[:, k]) <= eps * scale

def check_rows(T: int, limit: int) -> np.ndarray:
    """Rows checked against the reference: all if T <= limit, else ``limit`` evenly spaced ones."""
    if T <= limit:
        return np.arange(T)
    return np.unique(np.linspace(0, T - 1, limit).round().astype(np.int64))


def rel_err(got, want) -> float:
    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if not np.isfinite(g).all():
        return math.inf
    n = np.linalg.norm(w)
    return float(np.linalg.norm(g - w) / (n if n else 1.0))


# -- table (GPU-free) ------------------------------------------------------------------------------
def row_label(p: dict) -> str:
    """The shape column: the shape, with '/shared' or '/full' for those variants."""
    v = p.get("variant", "routed")
    return p["shape"] if v == "routed" else f"{p['shape']}/{v}"


def label_width(shapes, variants=VARIANTS) -> int:
    """Width of the shape column: 16, or the longest label of the run."""
    return max([16] + [len(row_label(dict(shape=s.name, variant=v))) for s in shapes
                       for v in (variants if s.has_ext else ["routed"])])


def codes_label(p: dict) -> str:
    """The codes column of a point: its bits ('4', '4,2') for int codes, else its format's name."""
    if p.get("format", "int") != "int":
        return p["format"]
    b1, b2 = p["bits"]
    return str(b1) if b1 == b2 else f"{b1},{b2}"


def table_header(width: int = 16) -> str:
    return (f"{'shape':<{width}} {'dtype':<8} {'codes':>8} {'bs':>4} {'T':>5} | {'graph_us':>9} {'eager_us':>9} "
            f"{'torch_us':>9} | {'floor_us':>9} {'MB':>8} {'%floor':>6} | {'rel_err':>8} {'torch_err':>9}")


def _f(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}{spec}}"


def format_row(p: dict, width: int = 16) -> str:
    """One table line of a point dict (keys as in the JSON; missing/None values print as '-')."""
    bs = p.get("block_size")
    head = (f"{row_label(p):<{width}} {p['dtype']:<8} {codes_label(p):>8} {'-' if bs is None else bs:>4} "
            f"{p['T']:>5} | ")
    if p.get("error"):
        return head + "ERR " + p["error"]
    mb = None if p.get("floor_bytes") is None else p["floor_bytes"] / 1e6
    floor = _f(p.get("floor_us"), ".1f", 8) + ("*" if p.get("bound") == "flop" else " ")
    err = _f(p.get("rel_err"), ".2e", 8) + ("" if p.get("ok", True) else " FAIL")
    terr = p.get("torch_err")
    tcol = f"{terr:>9.2e}" if isinstance(terr, float) else f"{(terr or '-')[:9]:>9}"
    return (head + f"{_f(p.get('graph_us'), '.1f', 9)} {_f(p.get('eager_us'), '.1f', 9)} "
            f"{_f(p.get('torch_us'), '.1f', 9)} | {floor} {_f(mb, '.2f', 8)} {_f(p.get('pct_floor'), '.1f', 6)} | "
            f"{err} {tcol}")


def _reason(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    msg = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {msg}{where}"
