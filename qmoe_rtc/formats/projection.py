"""One projection of a QMoE layer's experts (:class:`ProjectionSpec`) and the array check every contract input
passes (:func:`require`): what :mod:`qmoe_rtc.contract` and each format's projection checks build on."""

from __future__ import annotations

from dataclasses import dataclass

from .._arrays import dtype_name, is_c_contiguous, shape_str
from ..errors import QMoEInputError
from .axis import WeightFormat, weight_format

__all__ = ["ProjectionSpec", "require"]


@dataclass(frozen=True)
class ProjectionSpec:
    """One projection (fc1, fc2 or fc3) of all experts: a matrix ``[N, K]`` per expert."""

    name: str  #: "fc1" | "fc2" | "fc3"
    bits: int
    N: int  #: output features
    K: int  #: input features
    block_size: int  #: 0 = row-wise
    row_bytes: int  #: ceil(K·b/8)
    scale_dtype: str  #: as given; FP4: float32, the form the device holds (qmoe_rtc.formats.fp4.engine_scales)
    #: "none" (zp = 2^(b−1), and every float format) | "packed" (zero-point tensor) | "offset" (zero_point_offset)
    zp_mode: str
    has_bias: bool
    bias_dtype: str | None
    #: the weight format's name (qmoe_rtc.formats): "int" (b-bit codes [E, N, ceil(K·b/8)]) | "fp8_e4m3" (float8
    #: e4m3fn codes [E, N, K]) | "mxfp4" | "nvfp4" (e2m1 codes [E, N, K/2])
    format: str = "int"

    @property
    def weight_format(self) -> WeightFormat:
        return weight_format(self.format)

    @property
    def decode_trait(self) -> str:
        """The device decode trait of the codes (a key of ``qmoe_rtc.specialize.vocab.CPP_ZP``)."""
        return self.weight_format.decode_trait(self.zp_mode)

    @property
    def scale_input(self) -> str:
        """The input holding this projection's scales (``fc1_global_scale`` for FP8 with block_size 0)."""
        per_expert = self.weight_format.scale.global_scale == "per-expert" and not self.block_size
        return f"{self.name}_global_scale" if per_expert else f"{self.name}_scales"

    @property
    def n_blocks(self) -> int:
        """Scales per row (1 when row-wise)."""
        return self.K // self.block_size if self.block_size else 1

    @property
    def zp_row_bytes(self) -> int:
        """Bytes of packed zero points per row (block-wise) or per expert (row-wise)."""
        n = self.n_blocks if self.block_size else self.N
        return (n * self.bits + 7) // 8  # packed like the codes (qmoe_rtc.formats.int_codes.packed_row_bytes)


def require(name, a, *, rank=None, shape=None, dtypes=None, where=""):
    """Refuse ``a`` (the input ``name``) unless it is a C-contiguous NumPy or CuPy array of the given rank, shape and
    dtypes: a :class:`~qmoe_rtc.errors.QMoEInputError` naming the input, what was expected and what came."""
    if a is None:
        raise QMoEInputError(name, "an array", "None", where or None)
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise QMoEInputError(name, "a NumPy or CuPy array", type(a).__name__)
    if rank is not None and len(a.shape) not in (rank if isinstance(rank, tuple) else (rank,)):
        want = " or ".join(str(r) for r in (rank if isinstance(rank, tuple) else (rank,)))
        raise QMoEInputError(name, f"rank {want}", f"shape {shape_str(a.shape)}", where or None)
    if shape is not None and tuple(int(d) for d in a.shape) != tuple(shape):
        raise QMoEInputError(name, f"shape {shape_str(shape)}", f"shape {shape_str(a.shape)}", where or None)
    if dtypes is not None and dtype_name(a) not in dtypes:
        raise QMoEInputError(name, f"dtype in {tuple(dtypes)}", f"dtype {dtype_name(a)}", where or None)
    if not is_c_contiguous(a):
        raise QMoEInputError(name, "a C-contiguous array", "a non-contiguous view", "call .copy() or ascontiguousarray")
