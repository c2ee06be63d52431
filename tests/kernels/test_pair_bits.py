"""The bit tricks of core/mma_pair.cuh, checked on the CPU against the source: the LOP3 truth table of
``and_or`` and the exact integer pairs it builds (a wrong table would corrupt every tensor-core engine's
weights, and no compile test would see it)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from qmoe_rtc.jit.compiler import cuda_src_dir


def _and_or_lut() -> int:
    src = (cuda_src_dir() / "core" / "mma_pair.cuh").read_text()
    body = src[src.index("u32 and_or(u32 x, u32 mask, u32 bits)"):]
    return int(re.search(r'lop3\.b32 %0, %1, %2, %3, (0x[0-9A-Fa-f]+);', body).group(1), 16)


def lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """PTX lop3.b32: bit i of the result is bit (a_i·4 + b_i·2 + c_i) of the 8-bit table."""
    out = np.zeros_like(a)
    for i in range(32):
        idx = ((a >> i) & 1) << 2 | ((b >> i) & 1) << 1 | ((c >> i) & 1)
        out |= ((lut >> idx) & 1).astype(a.dtype) << i
    return out


def test_and_or_lut_is_a_and_b_or_c():
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32) for _ in range(3))
    lut = _and_or_lut()
    np.testing.assert_array_equal(lop3(a, b, c, lut), (a & b) | c)


def test_and_or_builds_exact_bfloat16_integer_pairs():
    """(w >> 4j) & 0x000f000f | bf16x2(128, 128) is bf16x2(128 + q_lo, 128 + q_hi) for every 4-bit code:
    the engines subtract 128 + zp from it exactly."""
    lut = _and_or_lut()
    q = np.arange(16, dtype=np.uint32)
    w = (q[:, None] << 4 | q[None, :] << 20).ravel()  # nibble 1 of each half: pair j = 1
    v = lop3(w >> 4, np.full_like(w, 0x000F000F), np.full_like(w, 0x43004300), lut)
    lo = (v & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    hi = (v >> 16).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(lo, 128 + np.repeat(q, 16))
    np.testing.assert_array_equal(hi, 128 + np.tile(q, 16))
