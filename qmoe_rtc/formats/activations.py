"""FP8 activations [ext] (``activation_quant="fp8_e4m3"``): how a GEMM's input rows are rounded to float8 e4m3fn
with dynamic scales, one a row (``activation_quant_group=0``) or one per group of that many consecutive values
along K (DeepSeek's 128). docs/contract.md, "FP8 activations", is the definition this module computes:

- the row is taken in float32 (the layer input is exact there; FC2's input, the activation, is rounded to float32
  first), and split into groups along K (the last one may be short);
- a group's scale is ``s = fl32(amax / 448)``, amax its largest magnitude (``s = 1`` for an all-zero group);
- each value becomes the e4m3fn code nearest ``fl32(v / s)`` clamped to ±448 (ties to even mantissa), and the GEMM
  multiplies ``code · s`` exactly with the weights, summing in float32 or better;
- a group holding a NaN or an infinity gives NaN for every value of the group: its scale is NaN (its codes are
  those of the group with the non-finite values read as zero).

The float64 reference applies it (:func:`fake_quantize`, contract/reference.py); the GPU kernel that computes the
same codes and scales is ``cuda_src/activations/quantize_fp8.cuh`` (kernels/act_quant.py); no GPU engine multiplies
them yet: the executor refuses such a layer by name. Nothing here runs at import time.
"""

from __future__ import annotations

import numpy as np

from .fp8 import E4M3_MAX, decode_e4m3fn, encode_e4m3fn

__all__ = ["ACTIVATION_QUANTS", "fake_quantize", "group_count", "quantize_activations"]

#: What ``activation_quant`` [ext] takes: activations as given (the activation dtype), or float8 e4m3fn.
ACTIVATION_QUANTS = ("none", "fp8_e4m3")


def group_count(K: int, group: int) -> int:
    """Scales per row of K values: 1 with ``group`` 0 (a scale a row), else ``ceil(K / group)``."""
    return 1 if group <= 0 else -(-K // group)


def _groups(x, group: int) -> tuple[np.ndarray, int]:
    """``x`` ``[rows, K]`` in float32, zero-padded to whole groups: ``[rows, G, g]`` and K."""
    x32 = np.asarray(x, dtype=np.float32)
    if x32.ndim != 2:
        raise ValueError(f"activations must be [rows, K], got shape {x32.shape}")
    rows, K = x32.shape
    g = K if group <= 0 else group
    G = group_count(K, group)
    padded = np.zeros((rows, G * g), np.float32)
    padded[:, :K] = x32
    return padded.reshape(rows, G, g), K


def quantize_activations(x, group: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scales)``: e4m3fn codes ``[rows, K]`` uint8 and float32 scales ``[rows, G]`` (G =
    :func:`group_count`; NaN for a group holding a NaN or an infinity, whose codes are those of the group with its
    non-finite values read as zero)."""
    xg, K = _groups(x, group)
    finite = np.isfinite(xg)
    bad = ~finite.all(axis=-1)
    xg = np.where(finite, xg, np.float32(0))
    amax = np.abs(xg).max(axis=-1)  # [rows, G] f32
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1)).astype(np.float32)
    q = np.clip(xg / scales[..., None], -E4M3_MAX, E4M3_MAX).astype(np.float32)  # f32 division, then the clamp
    codes = encode_e4m3fn(q).reshape(q.shape[0], -1)[:, :K]
    return codes, np.where(bad, np.float32(np.nan), scales)


def fake_quantize(x, group: int = 0) -> np.ndarray:
    """The values the GEMM multiplies, ``code · scale`` ``[rows, K]`` float64 (exact), for rows ``x`` ``[rows, K]``."""
    codes, scales = quantize_activations(x, group)
    K = codes.shape[1]
    per = np.repeat(scales.astype(np.float64), K if group <= 0 else group, axis=1)[:, :K]  # each value's scale
    return decode_e4m3fn(codes).astype(np.float64) * per  # a NaN scale: the group's values NaN
