"""Small helpers to look at NumPy / CuPy arrays without importing CuPy eagerly."""

from __future__ import annotations

import numpy as np

__all__ = ["array_module", "is_cupy", "dtype_name", "np_dtype", "is_c_contiguous", "shape_str", "FLOAT_DTYPES"]

#: Activation dtypes the contract knows, by canonical name.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def is_cupy(a) -> bool:
    """True for a CuPy ndarray (checked by module name, so CuPy is not imported here)."""
    return type(a).__module__.split(".", 1)[0] == "cupy"


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
    try:
        dt = np.dtype(dt)
    except TypeError:
        return str(dt)
    return "bfloat16" if dt.name == "bfloat16" else dt.name


def is_c_contiguous(a) -> bool:
    flags = getattr(a, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
