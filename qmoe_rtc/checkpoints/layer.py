"""A model's MoE layer from its checkpoint, as the contract's inputs: the experts' gate and up
projections stacked into FC1 with ``swiglu_fusion=2`` (the I gate rows, then the I up rows), the down
projections into FC2, codes packed along K, scales [E, N, K/group] (row-wise: [E, N]), zero points
packed when they are not all 2^(b−1). NVFP4 (ModelOpt) projections also give ``fc*_global_scale``: [E]
when every row of an expert's FC shares its ``weight_scale_2`` (gate and up equal), else [E, N] per row.

Where the tensors are: :mod:`qmoe_rtc.checkpoints.naming` (found from the names: Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2`` and ``…gate_proj/up_proj/down_proj`` as llm-compressor writes
them, ``mlp.experts.{e}.gate_proj`` … of Qwen2/3-MoE, Qwen3-Next, OLMoE, DeepSeek and of Mixtral under
transformers 5, gpt-oss's fused experts). What the routing is (E, k, the renormalisation; for DeepSeek-V3,
Kimi-K2, GLM-4.5 and dots.llm1 the grouped sigmoid routing [ext] attributes) comes from ``config.json`` by
model type (:mod:`qmoe_rtc.checkpoints.model_config`), and the format (bits, group) from its
``quantization_config``: a field the layer needs and the file lacks is an error naming it, never a
default. Every expert 0 … E−1 must be there whole; a sigmoid router's ``gate.e_score_correction_bias``
becomes the layer's ``router_score_bias`` [E] float32 (in ``weights``), and a DeepSeek-style
``n_shared_experts`` must match the shared MLP found.

A shared MLP of intermediate size S·I (S times the routed experts' I) is split along its intermediate
dimension into S shared experts of I each: a SwiGLU MLP is the sum of the MLPs on any split of its
intermediate units, so the split is exact and gives the layout the GPU engines run (the routed one).
Otherwise it stays one shared expert of its own size (valid for the contract and the reference).
"""

from __future__ import annotations

import json

import numpy as np

from .._arrays import dtype_name
from ..errors import QMoEInputError, QMoEUnsupportedError
from ..formats.axis import weight_format
from ..formats.int_codes import pack_codes
from ..specialize.vocab import DTYPES as FLOAT_DTYPES
from . import formats
from .gpt_oss import load_gpt_oss
from .loaded import LoadedLayer
from .model_config import MoeConfig, moe_config
from .naming import SCHEMES, MoeNames, expert_indices, find_names
from .naming import moe_layers as _moe_layers
from .source import Checkpoint

__all__ = ["SCHEMES", "LoadedLayer", "load_layer", "moe_layers"]


class _Reader:
    """``reader(name)``: a required tensor; ``reader.optional(name)``: None when absent."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def __call__(self, name: str):
        return self.ckpt.get(name)

    def optional(self, name: str):
        return self.ckpt.get(name) if self.ckpt.has(name) else None


def _checkpoint(path) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else Checkpoint(path)


def moe_layers(path, scheme: str | None = None) -> list[int]:
    """The layer indices whose MoE experts the checkpoint at ``path`` (or a :class:`Checkpoint`) holds."""
    return _moe_layers(_checkpoint(path).names, scheme)


def _field(q: dict, keys: tuple, what: str, where: str = "config.json quantization_config"):
    """The first of ``keys`` present in ``q`` (an error naming the first key when none is)."""
    for k in keys:
        if q.get(k) is not None:
            return q[k]
    raise QMoEInputError(f"{where}.{keys[0]}", what, "missing")


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).lstrip("-").isdigit():
        raise QMoEInputError(name, "an integer", repr(v))
    return int(v)


def _version(v) -> tuple:
    """A version string's leading numbers ('0.19.0' -> (0, 19, 0)); () when it has none."""
    out = []
    for part in str(v or "").split("."):
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _format(ckpt: Checkpoint) -> dict:
    """The checkpoint's format from config.json's quantization_config: method, bits, group, the weight
    format of the contract's experts when not 'int' (:mod:`qmoe_rtc.formats`), and GPTQ's version or
    compressed-tensors' symmetry. Bits and group must be there (no default is assumed)."""
    q = ckpt.quantization
    method = q.get("quant_method")
    where = "config.json quantization_config"
    if method in ("modelopt", "mxfp4"):
        return _fp4_format(q)
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", q.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QMoEUnsupportedError(f"{where}.checkpoint_format {fmt!r}: GPTQ's 'gptq' (v1) and 'gptq_v2' are read")
        # act-order shows in each projection's g_idx, refused there when its groups are not contiguous
        return dict(method=method, bits=_int(_field(q, ("bits",), "the code width"), f"{where}.bits"),
                    group=_int(_field(q, ("group_size",), "the group size (-1: one per row)"), f"{where}.group_size"),
                    version=2 if fmt == "gptq_v2" else 1)
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise QMoEUnsupportedError(f"AWQ version {q.get('version')!r}: the GEMM packing is read")
        if not q.get("zero_point", True):
            raise QMoEUnsupportedError("AWQ without zero points (zero_point: false)")
        return dict(method=method, bits=_int(_field(q, ("bits", "w_bit"), "the code width"), f"{where}.bits"),
                    group=_int(_field(q, ("group_size", "q_group_size"), "the group size"), f"{where}.group_size"))
    if method == "compressed-tensors":
        return _compressed_format(q, where)
    if method == "fp8":
        bs = q.get("weight_block_size")
        if str(q.get("fmt", "e4m3")).lower() != "e4m3" or not bs or len(bs) != 2 or bs[0] != bs[1]:
            raise QMoEUnsupportedError(f"FP8 quantization_config {q}: e4m3 with square weight_block_size [b, b] is read "
                                       "(per-tensor scales would give FC1's gate and up rows two scales)")
        sf = q.get("scale_fmt")
        if sf not in (None, "ue8m0", "float32", "fp32"):
            raise QMoEUnsupportedError(f"{where}.scale_fmt {sf!r}: float or ue8m0 block scales are read")
        return dict(method=method, format="fp8_e4m3", bits=8, group=int(bs[0]))
    if method is None:
        raise QMoEInputError(f"{where}.quant_method", "a quantized checkpoint (GPTQ, AWQ, compressed-tensors, FP8, "
                             "MXFP4 or NVFP4)", "no quantization_config in config.json" if not q else "missing")
    raise QMoEUnsupportedError(f"config.json quantization_config.quant_method {method!r}: GPTQ, AWQ, "
                               "compressed-tensors (pack-quantized), FP8 block, gpt-oss MXFP4 (mxfp4) and "
                               "ModelOpt NVFP4 (modelopt) checkpoints are read")


def _compressed_format(q: dict, where: str) -> dict:
    """compressed-tensors ``pack-quantized``: one weight scheme of int codes, group or channel strategy."""
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    kinds = {g.get("format") for g in groups if g.get("format")} or {q.get("format")}
    if kinds != {"pack-quantized"}:
        raise QMoEUnsupportedError(f"compressed-tensors format {sorted(map(str, kinds))}: pack-quantized is read")
    args = [g.get("weights") or {} for g in groups]
    if not args:
        raise QMoEInputError(f"{where}.config_groups", "a group with weights", "none")
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder")
    if len({json.dumps({k: a.get(k) for k in keys}, sort_keys=True) for a in args}) != 1:
        raise QMoEUnsupportedError("compressed-tensors with several weight schemes (config_groups): one is read")
    w, wh = args[0], f"{where}.config_groups.weights"
    if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel") or w.get("actorder"):
        raise QMoEUnsupportedError(f"compressed-tensors weights {w}: int codes with the group or channel "
                                   "strategy (no act-order) are read")
    group = _int(_field(w, ("group_size",), "the group size", wh), f"{wh}.group_size") if w["strategy"] == "group" else -1
    if not isinstance(w.get("symmetric"), bool):
        raise QMoEInputError(f"{wh}.symmetric", "true or false", repr(w.get("symmetric")) if "symmetric" in w else "missing")
    bits = _int(_field(w, ("num_bits",), "the code width", wh), f"{wh}.num_bits")
    return dict(method="compressed-tensors", bits=bits, group=group, symmetric=w["symmetric"],
                dense=_version(q.get("version")) >= (0, 19))


def _fp4_format(q: dict) -> dict:
    """gpt-oss's MXFP4 (``mxfp4``: the fused experts :mod:`qmoe_rtc.checkpoints.gpt_oss` reads) or NVIDIA
    ModelOpt's NVFP4 (``modelopt`` with ``quant_algo: NVFP4``, blocks of 16: :func:`formats.nvfp4`)."""
    if q["quant_method"] == "mxfp4":
        return dict(method="mxfp4", format="mxfp4", bits=4, group=32)
    if str(q.get("quant_algo", "")).upper() != "NVFP4":
        raise QMoEUnsupportedError(f"ModelOpt quant_algo {q.get('quant_algo')!r}: NVFP4 checkpoints are read "
                                   "(FP8, INT4 AWQ and mixed-precision ModelOpt exports are not)")
    group = q.get("group_size")
    if group is None:  # newer exports keep it in config_groups' weights only
        ws = [g.get("weights") or {} for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
        group = next((w["group_size"] for w in ws if w.get("group_size")), 16)
    if int(group) != 16:
        raise QMoEUnsupportedError(f"ModelOpt NVFP4 with group_size {group}: blocks of 16 codes (one e4m3 scale "
                                   "each, the contract's NVFP4) are read")
    return dict(method="modelopt", format="nvfp4", bits=4, group=16)


def _projection(read, fmt: dict, prefix: str, K: int, N: int) -> formats.Quantized:
    if fmt["method"] == "gptq":
        return formats.gptq(read, prefix, fmt["bits"], fmt["group"], K, N, fmt["version"])
    if fmt["method"] == "awq":
        return formats.awq(read, prefix, fmt["bits"], fmt["group"], K, N)
    if fmt["method"] == "fp8":
        return formats.fp8_blocks(read, prefix, fmt["group"], K, N)
    if fmt["method"] == "modelopt":
        return formats.nvfp4(read, prefix, K, N)
    return formats.compressed(read, prefix, fmt["bits"], fmt["group"], K, N, fmt["symmetric"], fmt["dense"])


def load_layer(path, layer: int, *, scheme: str | None = None, progress=None) -> LoadedLayer:
    """Layer ``layer``'s experts from the GPTQ, AWQ, compressed-tensors, FP8, gpt-oss MXFP4 or ModelOpt NVFP4
    checkpoint at ``path`` (a .safetensors file or a folder with ``config.json``, or an open
    :class:`~qmoe_rtc.checkpoints.source.Checkpoint` to read many layers through), converted losslessly
    into the contract's inputs (``LoadedLayer``). ``progress(done, total)``, when given, is called after
    each expert (gpt-oss: once, its experts being read together). Raises ``QMoEInputError`` naming
    the tensor that is missing or malformed, ``QMoEUnsupportedError`` for a format it does not read."""
    ckpt = _checkpoint(path)
    try:
        return _load(ckpt, layer, scheme, progress)
    finally:
        if ckpt is not path:  # opened here: close its files
            ckpt.close()


def _load(ckpt: Checkpoint, layer: int, scheme: str | None, progress) -> LoadedLayer:
    names = find_names(ckpt.names, layer, scheme, str(ckpt.path))
    cfg = moe_config(ckpt.config, where=f"{ckpt.path / 'config.json' if ckpt.path.is_dir() else 'config.json'}")
    if names.projections is None:
        return load_gpt_oss(ckpt, layer, names.block, cfg, progress)
    fmt = _format(ckpt)
    if fmt["method"] == "mxfp4":
        raise QMoEUnsupportedError(f"quant_method 'mxfp4' with per-expert projections ({names.block}): gpt-oss's "
                                   "fused experts (mlp.experts.gate_up_proj_blocks ...) are the MXFP4 storage read")
    bits, group, E = fmt["bits"], fmt["group"], cfg.E
    scale = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv", "modelopt": "weight_scale"}.get(
        fmt["method"], "scales")
    _check_experts(ckpt, names, E, scale)
    gate = names.projections[0]
    sp = next((q for q in names.shared if ckpt.has(f"{q}.{gate}.{scale}")), None)
    if sp is None and (stray := [n for n in ckpt.names if any(n.startswith(q + ".") for q in names.shared)]):
        raise QMoEInputError(stray[0].rsplit(".", 2)[0] + f".{gate}.{scale}", "the shared expert's gate projection "
                             f"beside {stray[0]}", "missing")
    if sp is None and cfg.shared:  # DeepSeek-style n_shared_experts: a shared MLP that must be there
        raise QMoEInputError(f"{names.shared[1]}.{gate}.{scale}", f"the shared MLP of the n_shared_experts = "
                             f"{cfg.shared} shared experts config.json names", f"missing from {ckpt.path}")
    read = _Reader(ckpt)
    I, H = (_outputs(read, names.expert(0, j), scale, fmt) for j in (0, 2))
    if fmt["method"] == "fp8" and I % group:
        raise QMoEUnsupportedError(f"FP8 blocks of {group} rows with I = {I}: FC1's gate and up rows would share a "
                                   "block of scales")
    fc1, fc2 = [], []
    for e in range(E):
        g, u = (_projection(read, fmt, names.expert(e, j), H, I) for j in (0, 1))
        fc1.append((g, u))
        fc2.append(_projection(read, fmt, names.expert(e, 2), I, H))
        if progress is not None:
            progress(e + 1, E)
    weights = {}
    weights.update(_stack("fc1", fc1, bits))
    weights.update(_stack("fc2", [(d,) for d in fc2], bits))
    if sp is not None:
        weights.update(_shared(read, fmt, sp, names.projections, scale, H, I, cfg.shared))
        g = read.optional(f"{names.shared_gate}.weight")
        if g is not None:  # Linear(H, 1): [1, H] -> [H]; beside FP4's byte scales: float32
            sdt = weights["fc1_scales"].dtype
            weights["shared_gate_weight"] = _as_if_exact(np.asarray(g).reshape(-1),
                                                         sdt if dtype_name(sdt) in FLOAT_DTYPES else np.float32)
    attrs = dict(k=cfg.k, activation_type="swiglu", swiglu_fusion=2, expert_weight_bits=bits, block_size=max(group, 0),
                 normalize_routing_weights=cfg.normalize, **cfg.routing)
    if fmt.get("format", "int") != "int":  # FP8 / NVFP4 experts: their format's quant_type
        attrs["quant_type"] = weight_format(fmt["format"]).quant_type
    rw = next((read(f"{r}.weight") for r in names.routers if ckpt.has(f"{r}.weight")), None)
    up, down = names.projections[1:]
    src = {"fc1_experts_weights": f"{names.block}.experts.*.{{{gate},{up}}}",
           "fc2_experts_weights": f"{names.block}.experts.*.{down}"}
    bias = _score_bias(ckpt, names, cfg)
    if bias is not None:
        weights["router_score_bias"], src["router_score_bias"] = bias, names.score_bias
    return LoadedLayer(weights, attrs, rw, src, model_type=cfg.model_type)


def _score_bias(ckpt: Checkpoint, names: MoeNames, cfg: MoeConfig) -> np.ndarray | None:
    """The router's score-correction bias as the contract's ``router_score_bias`` [E] float32: required for a
    grouped sigmoid router (config.json's model type), refused beside a softmax one (it would be left out)."""
    name = names.score_bias
    if not cfg.score_bias:
        if ckpt.has(name):
            raise QMoEUnsupportedError(f"{name}: a score-correction bias belongs to a sigmoid router (DeepSeek-V3's "
                                       f"noaux_tc), but config.json's model type {cfg.model_type!r} is read as softmax "
                                       "top-k; the layer would leave the bias out")
        return None
    if not ckpt.has(name):
        raise QMoEInputError(name, f"the router's score-correction bias [E] (model type {cfg.model_type!r} chooses "
                             "experts by sigmoid score + this bias)", f"missing from {ckpt.path}")
    b = ckpt.get(name)
    if b.shape != (cfg.E,) or dtype_name(b.dtype) not in ("float32", "float16", "bfloat16"):
        raise QMoEInputError(name, f"[{cfg.E}] float32, float16 or bfloat16 (one per routed expert)",
                             f"shape {list(b.shape)} {b.dtype}")
    return np.ascontiguousarray(b.astype(np.float32))  # exact: every 16-bit float is a float32


def _check_experts(ckpt: Checkpoint, names: MoeNames, E: int, scale: str) -> None:
    """Every expert 0 … E−1 (E from config.json) has its three projections, and no expert past E has a
    tensor: a missing one is named, never loaded as fewer experts."""
    extra = sorted(e for e in expert_indices(ckpt.names, names) if e >= E)
    if extra:
        raise QMoEInputError(f"{names.block}.experts.{extra[0]}", f"experts 0 … {E - 1} (config.json's expert count)",
                             f"tensors of expert {extra[0]}")
    for e in range(E):
        for j in range(3):
            t = f"{names.expert(e, j)}.{scale}"
            if not ckpt.has(t):
                raise QMoEInputError(t, f"a tensor of the checkpoint (expert {e} of the {E} config.json names)",
                                     f"missing from {ckpt.path}")


def _shared(read, fmt: dict, sp: str, names: tuple, scale: str, H: int, I: int, n: int | None = None) -> dict:
    """The shared experts' contract inputs (``shared_fc1_*``, ``shared_fc2_*``) of the shared MLP at ``sp``,
    split into S experts of the routed I where its size is S·I (module docstring). ``n``: config.json's
    ``n_shared_experts`` (the MLP must then be n·I)."""
    gate, up, down = names
    Is = _outputs(read, f"{sp}.{gate}", scale, fmt)
    if n is not None and Is != n * I:
        raise QMoEInputError(f"{sp}.{gate}", f"{n * I} outputs (config.json n_shared_experts = {n} times the experts' "
                             f"{I})", str(Is))
    g, u = (_projection(read, fmt, f"{sp}.{n}", H, Is) for n in (gate, up))
    d = _projection(read, fmt, f"{sp}.{down}", Is, H)
    group = fmt["group"]
    S = Is // I if Is % I == 0 and (group <= 0 or I % group == 0) else 1
    w = Is // S
    parts = [(_rows(g, s * w, w), _rows(u, s * w, w), _cols(d, s * w, w)) for s in range(S)]
    out = _stack("shared_fc1", [(a, b) for a, b, _ in parts], fmt["bits"])
    out.update(_stack("shared_fc2", [(c,) for *_, c in parts], fmt["bits"]))
    return out


def _rows(p: formats.Quantized, start: int, n: int) -> formats.Quantized:
    """Outputs [start, start + n) of a projection (FP8: whole blocks of rows)."""
    z = None if p.zeros is None else p.zeros[start:start + n]
    s = p.scales[start // p.group:(start + n) // p.group] if p.square else p.scales[start:start + n]
    g = None if p.global_scale is None else p.global_scale[start:start + n]
    return formats.Quantized(p.q[start:start + n], s, z, p.bits, p.group, p.square, g)


def _cols(p: formats.Quantized, start: int, n: int) -> formats.Quantized:
    """Inputs [start, start + n) of a projection (whole scale groups; row-wise scales apply to every input)."""
    blocks = slice(start // p.group, (start + n) // p.group) if p.group else slice(None)
    z = None if p.zeros is None else p.zeros[:, blocks]
    return formats.Quantized(np.ascontiguousarray(p.q[:, start:start + n]), p.scales[:, blocks], z, p.bits, p.group,
                             p.square, p.global_scale)


def _as_if_exact(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` in ``dtype`` when that changes no value (a bfloat16 gate beside float16 scales), else as is."""
    b = a.astype(dtype)
    return b if np.array_equal(b.astype(np.float64), a.astype(np.float64)) else a


def _outputs(read, prefix: str, scale: str, fmt: dict) -> int:
    """N of a projection: from its scales [nb, N] (GPTQ, AWQ) or [N, nb] (compressed-tensors); FP8 from the
    weight [N, K] itself (its scales hold blocks of rows)."""
    if fmt["method"] == "fp8":
        return int(read(f"{prefix}.weight").shape[0])
    s = read(f"{prefix}.{scale}")
    if s.ndim != 2:
        raise QMoEInputError(f"{prefix}.{scale}", "a 2-D scale tensor", f"shape {list(s.shape)}")
    return int(s.shape[0] if scale == "weight_scale" else s.shape[1])


def _stack(name: str, rows: list[tuple], bits: int) -> dict:
    """Contract arrays of projection ``name`` from each expert's parts (FC1: gate then up rows)."""
    q = np.stack([np.concatenate([p.q for p in parts]) for parts in rows])  # [E, N, K]
    s = np.stack([np.concatenate([p.scales for p in parts]) for parts in rows])  # [E, N, nb]; FP8 [E, N/b, K/b]
    out = {f"{name}_experts_weights": pack_codes(q, bits),  # [E, N, K·b/8] u8
           f"{name}_scales": s if s.shape[2] > 1 or rows[0][0].group else s[..., 0]}  # [E, N, nb] or [E, N]
    if any(p.zeros is not None for parts in rows for p in parts):
        default = 1 << (bits - 1)
        z = np.stack([np.concatenate([p.zeros if p.zeros is not None else np.full(p.scales.shape, default, np.uint8)
                                      for p in parts]) for parts in rows])  # [E, N, nb]
        # block-wise: packed along the blocks [E, N, ceil(nb·b/8)]; row-wise: along N [E, ceil(N·b/8)]
        out[f"{name}_zero_points"] = pack_codes(z, bits) if rows[0][0].group else pack_codes(z[..., 0], bits)
    if rows[0][0].global_scale is not None:  # NVFP4: [E, N] per row, [E] where each expert's rows share one
        g = np.stack([np.concatenate([p.global_scale for p in parts]) for parts in rows])
        out[f"{name}_global_scale"] = np.ascontiguousarray(g[:, 0]) if np.all(g == g[:, :1]) else g
    return out
