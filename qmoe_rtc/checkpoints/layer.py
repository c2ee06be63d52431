"""A model's MoE layer from its checkpoint, as the contract's inputs: the experts' gate and up
projections stacked into FC1 with ``swiglu_fusion=2`` (the I gate rows, then the I up rows), the down
projections into FC2, codes packed along K, scales [E, N, K/group] (row-wise: [E, N]), zero points
packed when they are not all 2^(b−1). NVFP4 (ModelOpt) projections also give ``fc*_global_scale``: [E]
when every row of an expert's FC shares its ``weight_scale_2`` (gate and up equal), else [E, N] per row.

Naming schemes (the expert tensors' prefix; ``{L}`` layer, ``{e}`` expert; ``router`` the gate's linear):

    mixtral      model.layers.{L}.block_sparse_moe.experts.{e}.w1 / w3 / w2   router block_sparse_moe.gate
    moe_mlp      model.layers.{L}.mlp.experts.{e}.gate_proj / up_proj / down_proj   router mlp.gate
                 (Qwen2/3-MoE, OLMoE, DeepSeek); shared experts: mlp.shared_expert (Qwen2-MoE, with the
                 sigmoid gate mlp.shared_expert_gate) or mlp.shared_experts (DeepSeek)
    gpt_oss      model.layers.{L}.mlp.experts.gate_up_proj_blocks …: every expert fused in one tensor
                 (gpt-oss MXFP4, read by :mod:`qmoe_rtc.checkpoints.gpt_oss`)   router mlp.router

A shared MLP of intermediate size S·I (S times the routed experts' I) is split along its intermediate
dimension into S shared experts of I each: a SwiGLU MLP is the sum of the MLPs on any split of its
intermediate units, so the split is exact and gives the layout the GPU engines run (the routed one).
Otherwise it stays one shared expert of its own size (valid for the contract and the reference).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import QMoEInputError, QMoEUnsupportedError
from ..quantize import pack_codes
from . import formats
from .source import Checkpoint

__all__ = ["FUSED_SCHEMES", "SCHEMES", "LoadedLayer", "load_layer", "moe_layers"]

#: scheme -> (expert prefix, (gate, up, down) names, router prefix, shared-expert prefixes, shared gate prefix)
SCHEMES = {
    "mixtral": ("model.layers.{L}.block_sparse_moe.experts.{e}", ("w1", "w3", "w2"),
                "model.layers.{L}.block_sparse_moe.gate", (), None),
    "moe_mlp": ("model.layers.{L}.mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"), "model.layers.{L}.mlp.gate",
                ("model.layers.{L}.mlp.shared_expert", "model.layers.{L}.mlp.shared_experts"),
                "model.layers.{L}.mlp.shared_expert_gate"),
}
#: scheme -> the tensor that marks a layer's experts, for models storing every expert in one tensor
FUSED_SCHEMES = {"gpt_oss": "model.layers.{L}.mlp.experts.gate_up_proj_blocks"}


@dataclass
class LoadedLayer:
    """A layer's contract inputs: ``QMoE(**weights, **attributes)``. The scales keep their stored dtype
    (GPTQ and AWQ: float16), which fixes the dtype the layer is called with. ``router_weight`` [E, H] (the
    gate's linear, in its stored dtype) is left out of ``weights``: pass it as ``router_weight=`` for
    logits computed in the layer, in the dtype you call the layer with; ``router_bias`` [E] likewise
    (gpt-oss's router has one; None for the others)."""

    weights: dict
    attributes: dict
    router_weight: np.ndarray | None
    source: dict = field(default_factory=dict)  # contract input -> checkpoint tensors it came from
    router_bias: np.ndarray | None = None


class _Reader:
    """``reader(name)``: a required tensor; ``reader.optional(name)``: None when absent."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def __call__(self, name: str):
        return self.ckpt.get(name)

    def optional(self, name: str):
        return self.ckpt.get(name) if self.ckpt.has(name) else None


def _marker(scheme: str) -> str:
    """The name prefix ({L} the layer, {e} an expert) that a layer's experts of ``scheme`` start with."""
    return FUSED_SCHEMES[scheme] if scheme in FUSED_SCHEMES else SCHEMES[scheme][0] + "."


def _scheme(ckpt: Checkpoint, layer: int, scheme: str | None) -> str:
    names = [*SCHEMES, *FUSED_SCHEMES]
    if scheme is not None:
        if scheme not in names:
            raise QMoEInputError("scheme", f"one of {names} or None (found from the names)", repr(scheme))
        return scheme
    for name in names:
        if any(n.startswith(_marker(name).format(L=layer, e=0)) for n in ckpt.names):
            return name
    raise QMoEInputError("checkpoint", f"MoE experts of layer {layer} named as one of {names} "
                         "(e.g. model.layers.{L}.mlp.experts.{e}.gate_proj.qweight)", f"none in {ckpt.path}")


def _checkpoint(path) -> Checkpoint:
    return path if isinstance(path, Checkpoint) else Checkpoint(path)


def moe_layers(path, scheme: str | None = None) -> list[int]:
    """The layer indices whose MoE experts the checkpoint at ``path`` (or a :class:`Checkpoint`) holds."""
    ckpt = _checkpoint(path)
    found = set()
    pats = [re.escape(_marker(s)).replace(r"\{L\}", r"(\d+)").replace(r"\{e\}", r"\d+")
            for s in ([scheme] if scheme else [*SCHEMES, *FUSED_SCHEMES])]
    for name in ckpt.names:
        for pat in pats:
            if m := re.match(pat, name):
                found.add(int(m.group(1)))
    return sorted(found)


def _format(ckpt: Checkpoint) -> dict:
    """The checkpoint's format from config.json's quantization_config: method, bits, group, and GPTQ's
    version or compressed-tensors' symmetry."""
    q = ckpt.quantization
    method = q.get("quant_method")
    if method in ("modelopt", "mxfp4"):
        return _fp4_format(q)
    if method == "gptq":
        fmt = str(q.get("checkpoint_format", "gptq")).lower()
        return dict(method=method, bits=int(q.get("bits", 4)), group=int(q.get("group_size", 128)),
                    version=2 if fmt == "gptq_v2" else 1)
    if method == "awq":
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise QMoEUnsupportedError(f"AWQ version {q.get('version')!r}: the GEMM packing is read")
        if not q.get("zero_point", True):
            raise QMoEUnsupportedError("AWQ without zero points (zero_point: false)")
        return dict(method=method, bits=int(q.get("bits", q.get("w_bit", 4))),
                    group=int(q.get("group_size", q.get("q_group_size", 128))))
    if method == "compressed-tensors":
        if q.get("format") != "pack-quantized":
            raise QMoEUnsupportedError(f"compressed-tensors format {q.get('format')!r}: pack-quantized is read")
        groups = list((q.get("config_groups") or {}).values())
        args = [g.get("weights") or {} for g in groups]
        if not args:
            raise QMoEInputError("config.json quantization_config.config_groups", "a group with weights", "none")
        if len({json.dumps(a, sort_keys=True) for a in args}) != 1:
            raise QMoEUnsupportedError("compressed-tensors with several weight schemes (config_groups): one is read")
        w = args[0]
        if w.get("type", "int") != "int" or w.get("strategy") not in ("group", "channel") or w.get("actorder"):
            raise QMoEUnsupportedError(f"compressed-tensors weights {w}: int codes with the group or channel "
                                       "strategy (no act-order) are read")
        group = int(w.get("group_size") or -1) if w["strategy"] == "group" else -1
        return dict(method=method, bits=int(w.get("num_bits", 4)), group=group, symmetric=bool(w.get("symmetric", True)))
    if method == "fp8":
        bs = q.get("weight_block_size")
        if str(q.get("fmt", "e4m3")).lower() != "e4m3" or not bs or len(bs) != 2 or bs[0] != bs[1]:
            raise QMoEUnsupportedError(f"FP8 quantization_config {q}: e4m3 with square weight_block_size [b, b] is read "
                                       "(per-tensor scales would give FC1's gate and up rows two scales)")
        return dict(method=method, bits=8, group=int(bs[0]))
    raise QMoEUnsupportedError(f"config.json quantization_config.quant_method {method!r}: GPTQ, AWQ, "
                               "compressed-tensors (pack-quantized), FP8 block, gpt-oss MXFP4 (mxfp4) and "
                               "ModelOpt NVFP4 (modelopt) checkpoints are read")


def _fp4_format(q: dict) -> dict:
    """gpt-oss's MXFP4 (``mxfp4``: the fused experts :mod:`qmoe_rtc.checkpoints.gpt_oss` reads) or NVIDIA
    ModelOpt's NVFP4 (``modelopt`` with ``quant_algo: NVFP4``, blocks of 16: :func:`formats.nvfp4`)."""
    if q["quant_method"] == "mxfp4":
        return dict(method="mxfp4", bits=4, group=32)
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
    return dict(method="modelopt", bits=4, group=16)


def _projection(read, fmt: dict, prefix: str, K: int, N: int) -> formats.Quantized:
    if fmt["method"] == "gptq":
        return formats.gptq(read, prefix, fmt["bits"], fmt["group"], K, N, fmt["version"])
    if fmt["method"] == "awq":
        return formats.awq(read, prefix, fmt["bits"], fmt["group"], K, N)
    if fmt["method"] == "fp8":
        return formats.fp8_blocks(read, prefix, fmt["group"], K, N)
    if fmt["method"] == "modelopt":
        return formats.nvfp4(read, prefix, K, N)
    return formats.compressed(read, prefix, fmt["bits"], fmt["group"], K, N, fmt["symmetric"])


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
    scheme = _scheme(ckpt, layer, scheme)
    if scheme == "gpt_oss":
        from .gpt_oss import load_gpt_oss

        return load_gpt_oss(ckpt, layer, progress)
    fmt = _format(ckpt)
    if fmt["method"] == "mxfp4":
        raise QMoEUnsupportedError(f"quant_method 'mxfp4' with per-expert projections ({scheme}): gpt-oss's fused "
                                   "experts (mlp.experts.gate_up_proj_blocks ...) are the MXFP4 storage read")
    bits, group = fmt["bits"], fmt["group"]
    prefix, (gate, up, down), router, shared, shared_gate = SCHEMES[scheme]
    scale = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv", "modelopt": "weight_scale"}.get(
        fmt["method"], "scales")
    sp = next((q.format(L=layer) for q in shared if ckpt.has(f"{q.format(L=layer)}.{gate}.{scale}")), None)
    if sp is None and (stray := [n for n in ckpt.names if any(n.startswith(q.format(L=layer) + ".") for q in shared)]):
        raise QMoEInputError(stray[0].rsplit(".", 2)[0] + f".{gate}.{scale}", "the shared expert's gate projection "
                             f"beside {stray[0]}", "missing")
    E = 0
    while ckpt.has(f"{prefix.format(L=layer, e=E)}.{gate}.{scale}"):
        E += 1
    if E == 0:
        raise QMoEInputError(f"{prefix.format(L=layer, e=0)}.{gate}.{scale}", "a tensor of the checkpoint", "missing")
    read = _Reader(ckpt)
    I, H = (_outputs(read, f"{prefix.format(L=layer, e=0)}.{n}", scale, fmt) for n in (gate, down))
    if fmt["method"] == "fp8" and I % group:
        raise QMoEUnsupportedError(f"FP8 blocks of {group} rows with I = {I}: FC1's gate and up rows would share a "
                                   "block of scales")
    fc1, fc2 = [], []
    for e in range(E):
        p = prefix.format(L=layer, e=e)
        g, u = (_projection(read, fmt, f"{p}.{n}", H, I) for n in (gate, up))
        fc1.append((g, u))
        fc2.append(_projection(read, fmt, f"{p}.{down}", I, H))
        if progress is not None:
            progress(e + 1, E)
    weights = {}
    weights.update(_stack("fc1", [(g, u) for g, u in fc1], bits))
    weights.update(_stack("fc2", [(d,) for d in fc2], bits))
    if sp is not None:
        weights.update(_shared(read, fmt, sp, (gate, up, down), scale, H, I))
        g = read.optional(f"{shared_gate.format(L=layer)}.weight") if shared_gate else None
        if g is not None:  # Linear(H, 1): [1, H] -> [H]; beside FP4's byte scales: float32
            sdt = weights["fc1_scales"].dtype
            weights["shared_gate_weight"] = _as_if_exact(np.asarray(g).reshape(-1), sdt if sdt.kind == "f" else np.float32)
    cfg = ckpt.config
    _check_routing(cfg)
    k = int(cfg.get("num_experts_per_tok", cfg.get("num_experts_per_token", 2)))
    attrs = dict(k=k, activation_type="swiglu", swiglu_fusion=2, expert_weight_bits=bits, block_size=max(group, 0),
                 normalize_routing_weights=int(bool(cfg.get("norm_topk_prob", scheme == "mixtral"))))
    if fmt["method"] in ("fp8", "modelopt"):
        attrs["quant_type"] = "fp8" if fmt["method"] == "fp8" else "nvfp4"
    rw = read.optional(f"{router.format(L=layer)}.weight")
    src = {"fc1_experts_weights": f"{prefix.format(L=layer, e='*')}.{{{gate},{up}}}",
           "fc2_experts_weights": f"{prefix.format(L=layer, e='*')}.{down}"}
    return LoadedLayer(weights, attrs, rw, src)


#: config.json routing settings the contract's routing (softmax over the experts, top k, optionally
#: renormalised) computes, by key: a model with another value routes differently.
ROUTING = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (None, 1), "topk_group": (None, 1),
           "routed_scaling_factor": (None, 1, 1.0)}


def _check_routing(cfg: dict) -> None:
    """Refuse a model whose router the contract's softmax top-k would not reproduce (DeepSeek-V3's sigmoid
    scores with grouped top-k and a scaling factor, say), naming the config.json key."""
    for key, ok in ROUTING.items():
        v = cfg.get(key)
        if v is not None and v not in ok:
            raise QMoEUnsupportedError(f"config.json {key} = {v!r}: the layer routes by softmax over the experts and "
                                       f"top k ({key} {' or '.join(repr(o) for o in ok if o is not None)}), so it "
                                       "would compute another function than this model's router")


def _shared(read, fmt: dict, sp: str, names: tuple, scale: str, H: int, I: int) -> dict:
    """The shared experts' contract inputs (``shared_fc1_*``, ``shared_fc2_*``) of the shared MLP at ``sp``,
    split into S experts of the routed I where its size is S·I (module docstring)."""
    gate, up, down = names
    Is = _outputs(read, f"{sp}.{gate}", scale, fmt)
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
