"""gpt-oss MXFP4 checkpoints (``quant_method: mxfp4`` in config.json, OpenAI's gpt-oss-20b / -120b as
Hugging Face stores them): every expert of a layer in one fused tensor per projection, under
``model.layers.{L}.mlp``::

    experts.gate_up_proj_blocks  [E, 2I, H/32, 16] uint8   32 e2m1 codes per block, two per byte, the even
                                                           element in the low nibble
    experts.gate_up_proj_scales  [E, 2I, H/32] uint8       e8m0: 2^(s − 127) per block (255 = NaN, refused)
    experts.gate_up_proj_bias    [E, 2I] bfloat16          rows 0, 2, 4 … the gate (glu), 1, 3, 5 … linear
    experts.down_proj_blocks     [E, H, I/32, 16] uint8
    experts.down_proj_scales     [E, H, I/32] uint8
    experts.down_proj_bias       [E, H] bfloat16
    router.weight [E, H], router.bias [E]

That is the contract's MXFP4 layout (:mod:`qmoe_rtc.formats.fp4`) already: a row's blocks of 16 bytes laid end
to end are its K/2 code bytes, so FC1 is ``gate_up_proj_blocks`` reshaped to [E, 2I, H/2] with its
scales and bias as they are, the interleaved gate/linear rows being ``swiglu_fusion=1``; FC2 the same
from ``down_proj``. gpt-oss's activation ``glu · sigmoid(1.702 · glu) · (linear + 1)`` with glu clamped
to at most ``swiglu_limit`` and linear to ±``swiglu_limit`` is the contract's swiglu with
``activation_alpha=1.702``, ``activation_beta=1``; its routing (softmax over the top k logits) is the
softmax over all experts, top k, renormalised. The biases keep their stored dtype (bfloat16: the layer
is called with bfloat16 activations, or cast them to float32, exactly).
"""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name
from ..errors import QMoEInputError, QMoEUnsupportedError
from ..formats.axis import MXFP4
from ..formats.fp4 import check_fp4_scales
from ..specialize.vocab import DTYPES as FLOAT_DTYPES
from .loaded import LoadedLayer
from .model_config import MoeConfig
from .source import Checkpoint

__all__ = ["PREFIX", "load_gpt_oss"]

#: The tensors' usual prefix (``{L}``: the layer; :mod:`qmoe_rtc.checkpoints.naming` finds the actual one).
PREFIX = "model.layers.{L}.mlp"
#: gpt-oss's activation constant (``sigmoid(1.702 · glu)``) and default clamp.
ALPHA, LIMIT = 1.702, 7.0


def _shape(a) -> str:
    return f"{dtype_name(a)} {list(a.shape)}"


def _codes(ckpt: Checkpoint, name: str, E: int | None, N: int | None, K: int | None):
    """``name_blocks`` [E, N, K/32, 16] uint8 and ``name_scales`` [E, N, K/32] (e8m0) as the contract's
    codes [E, N, K/2] and scales; None sizes are read from the tensor. Returns (codes, scales, E, N, K)."""
    bn, sn = f"{name}_blocks", f"{name}_scales"
    b = ckpt.get(bn)
    if dtype_name(b) != "uint8" or b.ndim != 4 or int(b.shape[3]) != 16:
        raise QMoEInputError(bn, "uint8 [E, N, K/32, 16] (MXFP4 blocks of 32 e2m1 codes, two per byte)", _shape(b))
    if K is not None and K % 32:
        raise QMoEInputError(bn, f"K = {K} a multiple of 32 (MXFP4 blocks of 32 codes)", f"K = {K}")
    want = tuple(int(g) if d is None else d for d, g in zip((E, N, None if K is None else K // 32), b.shape))
    if tuple(int(d) for d in b.shape[:3]) != want:
        raise QMoEInputError(bn, f"uint8 {list(want) + [16]}", _shape(b))
    E, N, K = want[0], want[1], 32 * want[2]
    s = ckpt.get(sn)
    if dtype_name(s) not in ("uint8", "float8_e8m0fnu") or tuple(int(d) for d in s.shape) != want:
        raise QMoEInputError(sn, f"uint8 {list(want)} (e8m0 scales, one per block of 32)", _shape(s))
    s = np.ascontiguousarray(s).view(np.uint8)
    check_fp4_scales(MXFP4, s, name=sn)
    return np.ascontiguousarray(b).reshape(E, N, K // 2), s, E, N, K


def _bias(ckpt: Checkpoint, name: str, shape: tuple):
    a = ckpt.get(name)
    if dtype_name(a) not in FLOAT_DTYPES or tuple(int(d) for d in a.shape) != shape:
        raise QMoEInputError(name, f"a float tensor {list(shape)} (float32, float16 or bfloat16)", _shape(a))
    return np.ascontiguousarray(a)


def load_gpt_oss(ckpt: Checkpoint, layer: int, block: str, cfg: MoeConfig, progress=None) -> LoadedLayer:
    """Layer ``layer`` of a gpt-oss MXFP4 checkpoint (its MoE block's prefix ``block``, its routing ``cfg``
    from config.json) as the contract's MXFP4 experts (module docstring): ``weights`` FC1/FC2 codes, scales
    and biases, ``router_weight`` / ``router_bias`` the router's linear (None when the checkpoint lacks it).
    Refuses malformed tensors naming them (``QMoEInputError``) and another quantization of these names
    (``QMoEUnsupportedError``)."""
    method = ckpt.quantization.get("quant_method")
    if method not in (None, "mxfp4"):
        raise QMoEUnsupportedError(f"config.json quantization_config.quant_method {method!r} with gpt-oss's fused "
                                   "experts (experts.gate_up_proj_blocks): their MXFP4 storage (quant_method "
                                   "'mxfp4') is read")
    p = block
    w1, s1, E, N1, H = _codes(ckpt, f"{p}.experts.gate_up_proj", None, None, None)
    if N1 % 2:
        raise QMoEInputError(f"{p}.experts.gate_up_proj_blocks", "an even number 2I of rows in dim 1 (gate and "
                             "linear rows interleaved)", f"{N1} rows")
    I = N1 // 2
    if cfg.E != E:
        raise QMoEInputError(f"{p}.experts.gate_up_proj_blocks", f"{cfg.E} experts in dim 0 (config.json "
                             "num_local_experts)", f"{E}")
    w2, s2, *_ = _codes(ckpt, f"{p}.experts.down_proj", E, H, I)
    weights = {"fc1_experts_weights": w1, "fc1_scales": s1,
               "fc1_experts_bias": _bias(ckpt, f"{p}.experts.gate_up_proj_bias", (E, N1)),
               "fc2_experts_weights": w2, "fc2_scales": s2,
               "fc2_experts_bias": _bias(ckpt, f"{p}.experts.down_proj_bias", (E, H))}
    rw = rb = None
    if ckpt.has(f"{p}.router.weight"):
        rw = _bias(ckpt, f"{p}.router.weight", (E, H))
        rb = _bias(ckpt, f"{p}.router.bias", (E,)) if ckpt.has(f"{p}.router.bias") else None
    limit = ckpt.config.get("swiglu_limit", LIMIT)  # gpt-oss's configs before it was a field: its constant 7
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise QMoEInputError("config.json swiglu_limit", "a positive number", repr(limit))
    attrs = dict(k=cfg.k, quant_type=MXFP4.quant_type, block_size=MXFP4.scale.block, expert_weight_bits=4,
                 activation_type="swiglu", swiglu_fusion=1, activation_alpha=ALPHA, activation_beta=1.0,
                 swiglu_limit=float(limit), normalize_routing_weights=cfg.normalize)
    src = {f"fc1_{t}": f"{p}.experts.gate_up_proj_{n}" for t, n in (("experts_weights", "blocks"),
                                                                     ("scales", "scales"), ("experts_bias", "bias"))}
    src.update({f"fc2_{t}": f"{p}.experts.down_proj_{n}" for t, n in (("experts_weights", "blocks"),
                                                                      ("scales", "scales"), ("experts_bias", "bias"))})
    if progress is not None:  # every expert comes in the same few reads
        progress(E, E)
    return LoadedLayer(weights, attrs, rw, src, router_bias=rb, model_type=cfg.model_type)
