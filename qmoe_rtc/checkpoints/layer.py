"""A model's MoE layer from its checkpoint, as the contract's inputs: the experts' gate and up
projections stacked into FC1 with ``swiglu_fusion=2`` (the I gate rows, then the I up rows), the down
projections into FC2, codes packed along K, scales [E, N, K/group] (row-wise: [E, N]), zero points
packed when they are not all 2^(b−1).

Naming schemes (the expert tensors' prefix; ``{L}`` layer, ``{e}`` expert; ``router`` the gate's linear):

    mixtral      model.layers.{L}.block_sparse_moe.experts.{e}.w1 / w3 / w2   router block_sparse_moe.gate
    moe_mlp      model.layers.{L}.mlp.experts.{e}.gate_proj / up_proj / down_proj   router mlp.gate
                 (Qwen2/3-MoE, OLMoE, DeepSeek's routed experts)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from ..errors import QMoEInputError, QMoEUnsupportedError
from ..quantize import pack_codes
from . import formats
from .source import Checkpoint

__all__ = ["SCHEMES", "LoadedLayer", "load_layer", "moe_layers"]

#: scheme -> (expert prefix, (gate, up, down) names, router prefix, shared-expert markers)
SCHEMES = {
    "mixtral": ("model.layers.{L}.block_sparse_moe.experts.{e}", ("w1", "w3", "w2"),
                "model.layers.{L}.block_sparse_moe.gate", ()),
    "moe_mlp": ("model.layers.{L}.mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"), "model.layers.{L}.mlp.gate",
                ("model.layers.{L}.mlp.shared_expert.", "model.layers.{L}.mlp.shared_experts.")),
}


@dataclass
class LoadedLayer:
    """A layer's contract inputs: ``QMoE(**weights, **attributes)``. ``router_weight`` [E, H] (the gate's
    linear, in its stored dtype) is left out of ``weights``: pass it as ``router_weight=`` for logits
    computed in the layer, in the dtype you call the layer with."""

    weights: dict
    attributes: dict
    router_weight: np.ndarray | None
    source: dict = field(default_factory=dict)  # contract input -> checkpoint tensors it came from


class _Reader:
    """``reader(name)``: a required tensor; ``reader.optional(name)``: None when absent."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def __call__(self, name: str):
        return self.ckpt.get(name)

    def optional(self, name: str):
        return self.ckpt.get(name) if self.ckpt.has(name) else None


def _scheme(ckpt: Checkpoint, layer: int, scheme: str | None) -> str:
    if scheme is not None:
        if scheme not in SCHEMES:
            raise QMoEInputError("scheme", f"one of {list(SCHEMES)} or None (found from the names)", repr(scheme))
        return scheme
    for name, (prefix, *_rest) in SCHEMES.items():
        if any(n.startswith(prefix.format(L=layer, e=0) + ".") for n in ckpt.names):
            return name
    raise QMoEInputError("checkpoint", f"MoE experts of layer {layer} named as one of {list(SCHEMES)} "
                         "(e.g. model.layers.{L}.mlp.experts.{e}.gate_proj.qweight)", f"none in {ckpt.path}")


def moe_layers(path, scheme: str | None = None) -> list[int]:
    """The layer indices whose MoE experts the checkpoint at ``path`` holds."""
    ckpt = Checkpoint(path)
    found = set()
    for name in ckpt.names:
        for prefix, *_rest in (SCHEMES[scheme],) if scheme else SCHEMES.values():
            pat = re.escape(prefix).replace(r"\{L\}", r"(\d+)").replace(r"\{e\}", r"\d+")
            if m := re.match(pat + r"\.", name):
                found.add(int(m.group(1)))
    return sorted(found)


def _format(ckpt: Checkpoint) -> tuple[str, int, int, int]:
    """(method, bits, group, GPTQ version) from config.json's quantization_config."""
    q = ckpt.quantization
    method = q.get("quant_method")
    if method not in ("gptq", "awq"):
        raise QMoEUnsupportedError(f"config.json quantization_config.quant_method {method!r}: GPTQ and AWQ "
                                   "checkpoints are read")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        raise QMoEUnsupportedError(f"AWQ version {q.get('version')!r}: the GEMM packing is read")
    if method == "awq" and not q.get("zero_point", True):
        raise QMoEUnsupportedError("AWQ without zero points (zero_point: false)")
    version = 2 if str(q.get("checkpoint_format", "gptq")).lower() == "gptq_v2" else 1
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return method, int(q.get("bits", q.get("w_bit", 4))), group, version


def _projection(read, method, bits, group, version, prefix, K, N):
    if method == "gptq":
        return formats.gptq(read, prefix, bits, group, K, N, version)
    return formats.awq(read, prefix, bits, group, K, N)


def load_layer(path, layer: int, *, scheme: str | None = None, progress=None) -> LoadedLayer:
    """Layer ``layer``'s experts from the GPTQ or AWQ checkpoint at ``path`` (a .safetensors file or a
    folder with ``config.json``), converted losslessly into the contract's inputs (``LoadedLayer``).
    ``progress(done, total)``, when given, is called after each expert. Raises ``QMoEInputError`` naming
    the tensor that is missing or malformed, ``QMoEUnsupportedError`` for a format it does not read."""
    ckpt = Checkpoint(path)
    method, bits, group, version = _format(ckpt)
    scheme = _scheme(ckpt, layer, scheme)
    prefix, (gate, up, down), router, shared = SCHEMES[scheme]
    if found := [n for n in ckpt.names if any(n.startswith(s.format(L=layer)) for s in shared)]:
        raise QMoEUnsupportedError(f"layer {layer} has shared-expert tensors ({found[0]} ...): loading them is not "
                                   "built yet, and the layer without them would compute another function")
    E = 0
    while ckpt.has(f"{prefix.format(L=layer, e=E)}.{gate}.scales"):
        E += 1
    if E == 0:
        raise QMoEInputError(f"{prefix.format(L=layer, e=0)}.{gate}.scales", "a tensor of the checkpoint", "missing")
    read = _Reader(ckpt)
    first = read(f"{prefix.format(L=layer, e=0)}.{gate}.scales")  # [nb, I]
    I = int(first.shape[1])
    down_s = read(f"{prefix.format(L=layer, e=0)}.{down}.scales")  # [nb, H]
    H = int(down_s.shape[1])
    fc1, fc2 = [], []
    for e in range(E):
        p = prefix.format(L=layer, e=e)
        g, u = (_projection(read, method, bits, group, version, f"{p}.{n}", H, I) for n in (gate, up))
        fc1.append((g, u))
        fc2.append(_projection(read, method, bits, group, version, f"{p}.{down}", I, H))
        if progress is not None:
            progress(e + 1, E)
    weights = {}
    weights.update(_stack("fc1", [(g, u) for g, u in fc1], bits))
    weights.update(_stack("fc2", [(d,) for d in fc2], bits))
    cfg = ckpt.config
    k = int(cfg.get("num_experts_per_tok", cfg.get("num_experts_per_token", 2)))
    attrs = dict(k=k, activation_type="swiglu", swiglu_fusion=2, expert_weight_bits=bits, block_size=max(group, 0),
                 normalize_routing_weights=int(bool(cfg.get("norm_topk_prob", scheme == "mixtral"))))
    rw = read.optional(f"{router.format(L=layer)}.weight")
    src = {"fc1_experts_weights": f"{prefix.format(L=layer, e='*')}.{{{gate},{up}}}",
           "fc2_experts_weights": f"{prefix.format(L=layer, e='*')}.{down}"}
    return LoadedLayer(weights, attrs, rw, src)


def _stack(name: str, rows: list[tuple], bits: int) -> dict:
    """Contract arrays of projection ``name`` from each expert's parts (FC1: gate then up rows)."""
    q = np.stack([np.concatenate([p.q for p in parts]) for parts in rows])  # [E, N, K]
    s = np.stack([np.concatenate([p.scales for p in parts]) for parts in rows])  # [E, N, nb]
    out = {f"{name}_experts_weights": pack_codes(q, bits),  # [E, N, K·b/8] u8
           f"{name}_scales": s if s.shape[2] > 1 or rows[0][0].group else s[..., 0]}  # [E, N, nb] or [E, N]
    if any(p.zeros is not None for parts in rows for p in parts):
        default = 1 << (bits - 1)
        z = np.stack([np.concatenate([p.zeros if p.zeros is not None else np.full(p.scales.shape, default, np.uint8)
                                      for p in parts]) for parts in rows])  # [E, N, nb]
        # block-wise: packed along the blocks [E, N, ceil(nb·b/8)]; row-wise: along N [E, ceil(N·b/8)]
        out[f"{name}_zero_points"] = pack_codes(z, bits) if rows[0][0].group else pack_codes(z[..., 0], bits)
    return out
