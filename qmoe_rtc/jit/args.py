"""Kernel argument specs and their packing: what a ``__global__`` function takes, by name and C type.

A :class:`KernelDef` names one kernel of a module (its NVRTC name expression) and lists its
arguments as :class:`Ptr` (a device pointer, with the dtype it must point to) and :class:`Scalar`
(a by-value argument packed as its declared C type). :class:`ParamBlock` turns those specs and
values into the ``void**`` array ``cuLaunchKernel`` reads, once; a caller may then overwrite chosen
pointer slots between launches (the per-call input and output) without repacking anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import dtype_name, is_c_contiguous, is_cupy, shape_str
from ..errors import DeviceError, QMoEAttributeError, QMoEInputError

__all__ = ["CTYPES", "KernelDef", "Launch", "ParamBlock", "Ptr", "Scalar", "check_pointer", "pack_value"]

#: Scalar C types an argument may declare, and the NumPy type each is packed as.
CTYPES = {"int32": np.int32, "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64,
          "float32": np.float32, "float64": np.float64}
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1), "int64": (-(2**63), 2**63 - 1),
               "uint64": (0, 2**64 - 1)}


@dataclass(frozen=True)
class Ptr:
    """A device-pointer argument to an array of ``dtype`` (None: any). ``nullable``: None passes NULL.
    A ``bfloat16`` pointer also accepts a ``uint16`` array (CuPy builds without bfloat16)."""

    name: str
    dtype: str | None
    nullable: bool = False


@dataclass(frozen=True)
class Scalar:
    """A by-value argument packed as the declared C type (``int32``, ``float32`` ...)."""

    name: str
    ctype: str

    def __post_init__(self) -> None:
        if self.ctype not in CTYPES:
            raise QMoEAttributeError(f"Scalar({self.name}).ctype", f"one of {list(CTYPES)}", repr(self.ctype))


@dataclass(frozen=True)
class KernelDef:
    """One ``__global__`` entry of a module: ``key`` (Python-side name), the C++ name expression
    handed to nvrtcAddNameExpression, and the argument specs in order."""

    key: str
    name_expr: str
    args: tuple

    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


@dataclass(frozen=True)
class Launch:
    """Launch geometry, plus the scalar arguments the kernel family derives from the problem
    (e.g. a K split), as ``(name, value)`` pairs bound by name like every other argument.

    ``overlap``: the kernel may start before the previous launch on its stream has finished
    (programmatic dependent launch, sm_90+): it waits (``griddepcontrol.wait``) before it reads
    anything an earlier launch writes, and releases its own dependents only after that wait
    (``cuda_src/core/pdl.cuh``). Whoever launches decides whether to use it.
    """

    grid: tuple
    block: tuple
    shared_mem: int = 0
    args: tuple = ()
    overlap: bool = False


def check_pointer(where: str, spec: Ptr, value, device_id: int | None) -> int:
    """The device address of ``value`` (a CuPy array) for ``spec``, after dtype/contiguity/device checks."""
    if value is None:
        if spec.nullable:
            return 0
        raise QMoEInputError(where, f"a device array of {spec.dtype or 'any dtype'}", "None")
    if not is_cupy(value):
        raise QMoEInputError(where, "a CuPy ndarray (device pointer)", type(value).__name__)
    dt = dtype_name(value)
    if spec.dtype is not None and dt != spec.dtype and not (spec.dtype == "bfloat16" and dt == "uint16"):
        raise QMoEInputError(where, f"dtype {spec.dtype}", f"{dt} {shape_str(value.shape)}")
    if not is_c_contiguous(value):
        raise QMoEInputError(where, "a C-contiguous array", f"strides {value.strides} for shape {shape_str(value.shape)}")
    if device_id is not None and value.device.id != device_id:
        raise DeviceError(f"argument '{where}' lives on device {value.device.id}, the kernel on device {device_id}")
    return int(value.data.ptr)


def pack_value(where: str, spec: Scalar, value):
    """``value`` as the NumPy scalar of ``spec.ctype`` (integers range-checked, no bool, no arrays)."""
    if is_cupy(value) or (isinstance(value, np.ndarray) and value.ndim > 0):
        raise QMoEInputError(where, f"a scalar ({spec.ctype})", f"an array {shape_str(value.shape)}")
    np_t = CTYPES[spec.ctype]
    if spec.ctype in _INT_RANGES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise QMoEInputError(where, f"an integer ({spec.ctype})", f"{type(value).__name__} {value!r}")
        lo, hi = _INT_RANGES[spec.ctype]
        if not lo <= int(value) <= hi:
            raise QMoEInputError(where, f"a value in [{lo}, {hi}] ({spec.ctype})", str(int(value)))
        return np_t(int(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise QMoEInputError(where, f"a real number ({spec.ctype})", f"{type(value).__name__} {value!r}")
    return np_t(value)


class ParamBlock:
    """The ``void**`` parameter array of one launch, packed once.

    Every argument gets an 8-byte slot (kernel parameters are at most 8 bytes here); a 4-byte type
    sits in the slot's low half (little endian), which is what the driver copies. ``address`` is the
    ``void**`` to hand to ``cuLaunchKernel``. ``values`` is the slot array itself: a launcher may
    overwrite a pointer slot (``values[i] = address``, or :meth:`set_pointer`) between launches; the
    driver copies parameters at launch, so a slot may change right after a launch returns.
    """

    __slots__ = ("values", "_ptrs", "address", "names")

    def __init__(self, kdef: KernelDef, values: dict, device_id: int | None = None):
        n = len(kdef.args)
        self.values = np.zeros(max(n, 1), dtype=np.uint64)  # [n] 8-byte slots
        self.names = kdef.arg_names()
        for i, spec in enumerate(kdef.args):
            if spec.name not in values:
                raise QMoEInputError(f"{kdef.key}.{spec.name}", "a bound value", "nothing (no binding of that name)")
            v = values[spec.name]
            where = f"{kdef.key}.{spec.name}"
            if isinstance(spec, Ptr):
                self.values[i] = v if isinstance(v, (int, np.integer)) else check_pointer(where, spec, v, device_id)
            else:
                packed = pack_value(where, spec, v)
                self.values[i : i + 1].view(packed.dtype)[0] = packed
        base = self.values.ctypes.data
        self._ptrs = (base + 8 * np.arange(max(n, 1), dtype=np.uint64)).astype(np.uint64)  # [n] void*
        self.address = int(self._ptrs.ctypes.data)

    def set_pointer(self, index: int, address: int) -> None:
        self.values[index] = address

    def value(self, index: int) -> int:
        return int(self.values[index])
