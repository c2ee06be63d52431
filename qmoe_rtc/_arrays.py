"""Small helpers to look at NumPy / CuPy arrays and torch tensors without importing CuPy or torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ArrayMeta", "array_module", "device_of", "dtype_name", "is_c_contiguous", "is_cupy",
           "is_torch", "np_dtype", "shape_str"]


@dataclass(frozen=True)
class ArrayMeta:
    """What validation reads of an array, taken without touching CUDA: shape, dtype name, C-contiguity
    and the CUDA device (None: host memory). The contract's checks accept it in place of the array."""

    shape: tuple
    dtype: str
    contiguous: bool
    device: int | None

    @property
    def flags(self) -> dict:
        return {"C_CONTIGUOUS": self.contiguous}


def is_cupy(a) -> bool:
    """True for a CuPy ndarray (checked by module name, so CuPy is not imported here)."""
    return type(a).__module__.split(".", 1)[0] == "cupy"


def is_torch(a) -> bool:
    """True for a torch tensor (checked by module name, so torch is not imported here)."""
    return type(a).__module__.split(".", 1)[0] == "torch"


def device_of(a) -> int | None:
    """The CUDA device an array lives on, None for host memory (NumPy, CPU tensors)."""
    if isinstance(a, ArrayMeta):
        return a.device
    if is_cupy(a):
        return int(a.device.id)
    if is_torch(a):
        return int(a.device.index) if a.device.type == "cuda" else None
    return None


def array_module(a):
    """``cupy`` for CuPy arrays, else ``numpy``."""
    if is_cupy(a):
        import cupy

        return cupy
    return np


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a canonical name; ``bfloat16`` comes from ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def dtype_name(a_or_dtype) -> str:
    """Canonical dtype name (``float16``, ``bfloat16``, ``uint8`` ...) of an array or dtype."""
    dt = a_or_dtype if isinstance(a_or_dtype, (type, str, np.dtype)) else getattr(a_or_dtype, "dtype", a_or_dtype)
    if type(dt).__module__.split(".", 1)[0] == "torch":  # torch.float16 -> "float16"
        return str(dt).removeprefix("torch.")
    try:
        dt = np.dtype(dt)
    except TypeError:
        return str(dt)
    return "bfloat16" if dt.name == "bfloat16" else dt.name


def is_c_contiguous(a) -> bool:
    if is_torch(a):
        return bool(a.is_contiguous())
    flags = getattr(a, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
