"""The weight layouts ONNX Runtime (1.32) and its GenAI builder write for ``com.microsoft::QMoE``, turned
into this project's contract inputs (docs/contract.md), or refused by name. Read from ONNX Runtime's
operator schema and its CUDA kernel, and from the GenAI builder that writes these nodes:

- ``quant_type="int"``: ``weights_prepacked`` = 0 is the raw layout ``[E, N, ceil(K·b/8)]`` (the contract's,
  INT3 included). For 4- and 8-bit codes, 1 and -1 (the default: attribute absent) mean the execution
  provider's prepacked layout. ONNX Runtime's CPU kernel has none (raw), its CUDA kernel reads the
  CUTLASS fpA_intB layout for SM80 on every GPU (``[E, K, N·b/8]``, undone here exactly: a permutation of
  the codes, whose offset-binary values the packer leaves as they were). The GenAI builder writes the CUDA
  layout without the attribute, so a -1 node is read by its shapes; where both layouts have the same
  shape (an unfused layer with I = H) the caller says which (``int_layout``) or the node is refused.
- ``quant_type="fp4"`` is MXFP4: e2m1 codes ``[E, K, N/2]`` packed along N (transposed here), e8m0
  block scales ``[E, N, K/32]`` and a per-expert float32 global scale that multiplies. A power-of-two
  global scale folds exactly into the e8m0 exponents (the builder writes 1); any other is refused.
- ``quant_type="nvfp4"``: e2m1 codes ``[E, K, N/2]`` packed along N (``weights_prepacked`` -1 or 0), or
  the K-packed ``[E, N, K/2]`` bytes under the same ``[E, K, N/2]`` shape (1); e4m3 block scales and the
  per-expert global scale are the contract's.
- ``quant_type="fp8"`` is the contract's; ``wfp4afp8`` (FP8 activations) and the activation-scale inputs
  are refused: ONNX Runtime's activation scales are given (static), this project's FP8 activations [ext] are
  computed from each row (docs/contract.md, "FP8 activations").
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .._arrays import shape_str
from ..errors import QMoEAttributeError, QMoEInputError, QMoEUnsupportedError
from ..formats.axis import MXFP4, NVFP4

__all__ = ["ACT_SCALE_INPUTS", "INT_LAYOUTS", "to_contract", "unprepack_sm80"]

#: ONNX Runtime's inputs 17–20 (FP8 activation scales of ``wfp4afp8``).
ACT_SCALE_INPUTS = ("fc1_act_scale", "fc2_act_scale", "fc1_act_block_scale", "fc2_act_block_scale")
#: How a node with ``weights_prepacked`` -1 (absent) and 4/8-bit codes is read.
INT_LAYOUTS = ("auto", "raw", "cuda")
#: Attributes ONNX Runtime has and the contract does not: read here, not passed on.
_LAYOUT_ATTRS = ("weights_prepacked", "accuracy_level")
#: ONNX Runtime's FP4 quant_type values and the weight formats they are (its "fp4" is MXFP4).
_FP4 = {"fp4": MXFP4, "nvfp4": NVFP4}
#: The SM80 packer's row order inside one MMA tile of K rows (16-bit activations), by code width.
_ROW_PERMUTATION = {
    4: (0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
        4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31),
    8: (0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15),
}
#: The packer's last step orders the codes of each 32-bit word like this (by code width).
_WORD_PERMUTATION = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Codes ``[..., count]`` of ``packed`` ``[..., ceil(count·bits/8)]`` (4 bits: low nibble first; 8: bytes)."""
    if bits == 8:
        return packed[..., :count]
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out[..., :count]


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of :func:`_unpack` for an even count (4 bits) or any count (8 bits)."""
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4), dtype=np.uint8)


@lru_cache(maxsize=8)
def _sm80_order(N: int, K: int, bits: int) -> np.ndarray:
    """``order[i]`` = the raw position ``n·K + k`` of the i-th code of the SM80 prepacked stream."""
    idx = np.int64 if N * K >= 2**31 else np.int32
    rows = np.arange(K)
    tile = len(_ROW_PERMUTATION[bits])
    rows = (rows // tile) * tile + np.asarray(_ROW_PERMUTATION[bits])[rows % tile]
    kn = np.arange(N * K, dtype=idx).reshape(N, K).T[rows]          # [K, N]: raw position of each code
    flat = kn.T.reshape(-1)                                          # transposed: [N, K] row-major
    flat = flat.reshape(-1, 16 // bits, K // 64, 64).transpose(0, 2, 1, 3).reshape(-1)  # column interleave
    word = _WORD_PERMUTATION[bits]
    return np.ascontiguousarray(flat.reshape(-1, len(word))[:, list(word)].reshape(-1))


def unprepack_sm80(prepacked, N: int, K: int, bits: int, name: str = "weights") -> np.ndarray:
    """Raw contract codes ``[E, N, K·b/8]`` of ONNX Runtime CUDA's SM80 fpA_intB layout ``[E, K, N·b/8]``
    (4 or 8 bits): the exact inverse of that packer's permutations. Shapes the packer refuses are refused."""
    a = np.asarray(prepacked)
    want = (a.shape[0] if a.ndim == 3 else 0, K, N * bits // 8)
    if bits not in (4, 8) or a.ndim != 3 or tuple(a.shape) != want or a.dtype != np.uint8:
        raise QMoEInputError(name, f"uint8 {shape_str(want)} SM80-prepacked {bits}-bit codes",
                             f"{a.dtype} {shape_str(a.shape)}")
    if K % 64 or N % (8 * (8 // bits)):
        raise QMoEInputError(name, "K a multiple of 64 and N of 16 (4-bit) or 8 (8-bit), as the SM80 packer needs",
                             f"N={N}, K={K}")
    order = _sm80_order(N, K, bits)
    codes = _unpack(a.reshape(a.shape[0], -1), bits, N * K)          # [E, N·K] in prepacked order
    raw = np.empty_like(codes)
    raw[:, order] = codes
    return _pack(raw.reshape(-1, N, K), bits)                        # [E, N, K·b/8]


def _n_packed_to_k_packed(packed: np.ndarray) -> np.ndarray:
    """e2m1 codes ``[E, K, N/2]`` packed along N -> ``[E, N, K/2]`` packed along K (the contract's)."""
    codes = _unpack(packed, 4, 2 * packed.shape[-1])                 # [E, K, N]
    return _pack(codes.transpose(0, 2, 1), 4)                        # [E, N, K/2]


def _fold_pow2(label: str, slot: str, scales: np.ndarray, g: np.ndarray) -> np.ndarray:
    """e8m0 scales ``[E, N, K/32]`` times a power-of-two global scale ``[E]``, exactly, as e8m0 bytes."""
    g = np.asarray(g, dtype=np.float64).reshape(-1)
    mant, exp = np.frexp(g)
    if g.shape[0] != scales.shape[0] or not (np.isfinite(g).all() and (mant == 0.5).all()):
        raise QMoEUnsupportedError(
            f"{label} {slot}: an MXFP4 global scale must be [E] powers of two to fold exactly into the e8m0 block "
            f"scales (the contract's MXFP4 has no global scale); got {g[:4].tolist()}{'...' if g.size > 4 else ''}")
    s = scales.view(np.uint8).astype(np.int32)                       # [E, N, K/32]
    out = s + (exp.astype(np.int32) - 1)[:, None, None]
    nan = s == 255
    if ((out < 0) | (out > 254))[~nan].any():
        raise QMoEUnsupportedError(f"{label} {slot}: folding the global scale moves e8m0 scales out of 0..254")
    return np.where(nan, 255, out).astype(np.uint8)


def _bits(attrs: dict, p: str) -> int:
    v = attrs.get(f"{p}_expert_weight_bits")
    return int(attrs.get("expert_weight_bits", 4) if v is None else v)


def _fp4_to_contract(label: str, qt: str, prepacked: int, w: dict, attrs: dict) -> str:
    if w.get("fc3_experts_weights") is not None:
        raise QMoEUnsupportedError(f"{label} fc3_experts_weights: ONNX Runtime defines no FC3 layout for "
                                   f"quant_type='{qt}' (its CUDA kernel refuses FC3)")
    for slot in ("fc1_experts_weights", "fc2_experts_weights"):
        a = w[slot]
        if a.dtype != np.uint8 or a.ndim != 3:
            raise QMoEInputError(f"{label} {slot}", "uint8 [E, K, N/2] e2m1 codes", f"{a.dtype} {shape_str(a.shape)}")
        if qt == "nvfp4" and prepacked == 1:  # K-packed bytes under the N-packed shape
            s = w[slot.replace("experts_weights", "scales")]
            N = int(np.shape(s)[1]) if s is not None and np.ndim(s) == 3 else 0
            if not N or a.size % (a.shape[0] * N):
                raise QMoEInputError(f"{label} {slot}", "K-packed [E, N, K/2] bytes with N from the block scales",
                                     f"{shape_str(a.shape)}, scales {shape_str(np.shape(s))}")
            w[slot] = np.ascontiguousarray(a.reshape(a.shape[0], N, -1))
        else:
            w[slot] = _n_packed_to_k_packed(a)
    for p in ("fc1", "fc2"):
        g, s = w.get(f"{p}_global_scale"), w.get(f"{p}_scales")
        if g is None or s is None:
            raise QMoEInputError(f"{label} {p}_{'global_scale' if g is None else 'scales'}",
                                 f"present (ONNX Runtime requires it for quant_type='{qt}')", "absent")
        if qt == "fp4":
            w[f"{p}_scales"] = _fold_pow2(label, f"{p}_global_scale", np.asarray(s), g)
            del w[f"{p}_global_scale"]
    attrs["quant_type"] = _FP4[qt].quant_type  # the contract's spelling of the format
    attrs["block_size"] = _FP4[qt].scale.block
    return f"{qt}: N-packed codes transposed" if not (qt == "nvfp4" and prepacked == 1) else "nvfp4: K-packed"


def _int_shapes(w: dict, attrs: dict) -> dict:
    """slot -> (bits, N, K) of the 4/8-bit FC1/FC2 codes, N and K from the scales (None if unknown)."""
    s1, s2 = w.get("fc1_scales"), w.get("fc2_scales")
    if s1 is None or s2 is None or np.ndim(s1) < 2 or np.ndim(s2) < 2:
        return {}
    N1, H = int(np.shape(s1)[1]), int(np.shape(s2)[1])
    fused = attrs.get("activation_type") in ("swiglu", "geglu") and attrs.get("swiglu_fusion", 0) in (1, 2)
    out = {}
    for slot, p, N, K in (("fc1_experts_weights", "fc1", N1, H), ("fc2_experts_weights", "fc2", H, N1 // (1 + fused))):
        if _bits(attrs, p) in (4, 8):
            out[slot] = (_bits(attrs, p), N, K)
    return out


def _int_layout(label: str, prepacked: int, w: dict, attrs: dict, int_layout: str) -> str:
    """'raw' or 'cuda' for an integer node (see the module docstring)."""
    widths = {_bits(attrs, p) for p in ("fc1", "fc2", "fc3")}
    if prepacked == 0:
        return "raw"
    if prepacked == 1 and not widths <= {4, 8}:
        raise QMoEUnsupportedError(f"{label} weights_prepacked=1: ONNX Runtime defines prepacked layouts for 4- and "
                                   f"8-bit codes only (widths {sorted(widths)})")
    if prepacked == -1 and (not widths <= {4, 8} or w.get("fc3_experts_weights") is not None):
        return "raw"  # the CUDA kernel runs neither other widths nor FC3 prepacked: a raw (CPU) layout
    if prepacked == 1:
        return "cuda"
    shapes = _int_shapes(w, attrs)
    fits = {"raw": [], "cuda": []}
    for slot, (b, N, K) in shapes.items():
        got = tuple(np.shape(w[slot]))
        fits["raw"].append(got[1:] == (N, K * b // 8))
        fits["cuda"].append(got[1:] == (K, N * b // 8))
    if int_layout != "auto":
        return int_layout
    raw, cuda = shapes and all(fits["raw"]), shapes and all(fits["cuda"])
    if raw and cuda:
        raise QMoEUnsupportedError(
            f"{label} weights_prepacked: absent (-1), and the raw [E, N, K·b/8] and CUDA-prepacked [E, K, N·b/8] "
            "layouts have the same shapes here (I = H): say which with qmoe_nodes(..., int_layout='raw' or 'cuda')")
    return "cuda" if cuda else "raw"


def to_contract(label: str, weights: dict, attrs: dict, int_layout: str = "auto") -> str:
    """Turn one node's ``weights`` and ``attrs`` (ONNX Runtime's, edited in place) into contract inputs;
    returns a short description of the layout that was read. Refuses what it cannot read exactly."""
    if int_layout not in INT_LAYOUTS:
        raise QMoEInputError("int_layout", f"one of {INT_LAYOUTS}", repr(int_layout))
    prepacked = attrs.pop("weights_prepacked", -1)
    attrs.pop("accuracy_level", None)  # ONNX Runtime CPU's precision knob: no part of the layer
    if prepacked not in (-1, 0, 1):
        raise QMoEAttributeError(f"{label} weights_prepacked", "-1, 0 or 1", repr(prepacked))
    for slot in ACT_SCALE_INPUTS:
        if slot in weights:
            raise QMoEUnsupportedError(f"{label} {slot}: static FP8 activation scales (qmoe_rtc's FP8 activations "
                                       "[ext], activation_quant='fp8_e4m3', are computed from each row)")
    qt = attrs.get("quant_type", "int")
    if qt == "wfp4afp8":
        raise QMoEUnsupportedError(f"{label} quant_type='wfp4afp8': MXFP4 weights with FP8 activations of static "
                                   "scales (qmoe_rtc's FP8 activations [ext], activation_quant='fp8_e4m3', are "
                                   "computed from each row)")
    if (attrs.get("activation_type") == "swiglu" and attrs.get("swiglu_fusion", 0) == 0
            and weights.get("fc3_experts_weights") is None):
        attrs["swiglu_fusion"] = 1  # ONNX Runtime CUDA's rule for models written before the attribute existed
    if qt in _FP4:
        return _fp4_to_contract(label, qt, prepacked, weights, attrs)
    if qt != "int":
        return "raw"
    if _int_layout(label, prepacked, weights, attrs, int_layout) == "raw":
        return "raw"
    shapes = _int_shapes(weights, attrs)
    if len(shapes) != 2:
        raise QMoEInputError(f"{label} fc1_scales", "FC1 and FC2 scales (they give N and K of prepacked codes)",
                             "absent or not [E, N, ...]")
    for slot, (b, N, K) in shapes.items():
        weights[slot] = unprepack_sm80(weights[slot], N, K, b, name=f"{label} {slot}")
    return "int: CUDA SM80 prepacked, undone"
