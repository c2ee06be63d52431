"""Launcher: pack arguments by a kernel's declared spec and launch on a CuPy stream."""

from __future__ import annotations

import numpy as np

from .._arrays import dtype_name, is_c_contiguous, is_cupy, shape_str
from ..errors import DeviceError, QMoEInputError
from .family import CTYPES, KernelDef, Ptr, Scalar

__all__ = ["Kernel", "pack_args", "set_max_dynamic_smem"]

_INT_RANGES = {
    "int32": (-(2**31), 2**31 - 1),
    "uint32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "uint64": (0, 2**64 - 1),
}


def _pack_ptr(kdef: KernelDef, a: Ptr, value, device_id: int | None):
    where = f"{kdef.key}.{a.name}"
    if value is None:
        if a.nullable:
            return np.uint64(0)
        raise QMoEInputError(where, f"a device array of {a.dtype or 'any dtype'}", "None")
    if not is_cupy(value):
        raise QMoEInputError(where, "a CuPy ndarray (device pointer)", type(value).__name__)
    dt = dtype_name(value)
    if a.dtype is not None and dt != a.dtype and not (a.dtype == "bfloat16" and dt == "uint16"):
        raise QMoEInputError(where, f"dtype {a.dtype}", f"{dt} {shape_str(value.shape)}")
    if not is_c_contiguous(value):
        raise QMoEInputError(where, "a C-contiguous array", f"strides {value.strides} for shape {shape_str(value.shape)}")
    if device_id is not None and value.device.id != device_id:
        raise DeviceError(f"argument '{where}' lives on device {value.device.id}, kernel is loaded on device {device_id}")
    return value


def _pack_scalar(kdef: KernelDef, a: Scalar, value):
    where = f"{kdef.key}.{a.name}"
    if is_cupy(value) or isinstance(value, np.ndarray) and value.ndim > 0:
        raise QMoEInputError(where, f"a scalar ({a.ctype})", f"an array {shape_str(value.shape)}")
    np_t = np.dtype(CTYPES[a.ctype]).type
    if a.ctype in _INT_RANGES:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise QMoEInputError(where, f"an integer ({a.ctype})", f"{type(value).__name__} {value!r}")
        lo, hi = _INT_RANGES[a.ctype]
        if not lo <= int(value) <= hi:
            raise QMoEInputError(where, f"a value in [{lo}, {hi}] ({a.ctype})", str(int(value)))
        return np_t(int(value))
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, (bool, np.bool_)):
        raise QMoEInputError(where, f"a real number ({a.ctype})", f"{type(value).__name__} {value!r}")
    return np_t(value)


def pack_args(kdef: KernelDef, args, device_id: int | None = None) -> tuple:
    """Check ``args`` against ``kdef.args`` and convert each to what the launch packs: CuPy arrays
    (dtype / contiguity / device checked), null pointers as ``np.uint64(0)``, scalars as the NumPy
    scalar of their declared C type (range-checked)."""
    args = tuple(args)
    if len(args) != len(kdef.args):
        raise QMoEInputError(kdef.key, f"{len(kdef.args)} arguments {list(kdef.arg_names())}", f"{len(args)}")
    out = []
    for spec, value in zip(kdef.args, args):
        out.append(_pack_ptr(kdef, spec, value, device_id) if isinstance(spec, Ptr) else _pack_scalar(kdef, spec, value))
    return tuple(out)


def set_max_dynamic_smem(function, nbytes: int) -> None:
    """Let a CuPy ``Function`` take ``nbytes`` of dynamic shared memory (needed when static + dynamic > 48 KiB)."""
    from cupy_backends.cuda.api import driver

    driver.funcSetAttribute(function.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))


class Kernel:
    """A loaded kernel with its argument spec. ``kernel(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, kdef: KernelDef, function, device_id: int, module_name: str = ""):
        self.kdef = kdef
        self.function = function
        self.device_id = device_id
        self.module_name = module_name
        self._max_dyn_smem = 0  # opted-in dynamic shared memory (static + dynamic may pass 48 KiB)

    @property
    def key(self) -> str:
        return self.kdef.key

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None) -> None:
        packed = pack_args(self.kdef, args, self.device_id)
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
        if any(g <= 0 for g in grid) or any(b <= 0 for b in block):
            raise QMoEInputError(f"{self.kdef.key}.launch", "positive grid and block dimensions", f"grid {grid} block {block}")
        self.reserve_dynamic_smem(shared_mem)
        self.function(grid, block, packed, shared_mem=int(shared_mem), stream=stream)

    def reserve_dynamic_smem(self, nbytes: int) -> None:
        """Opt the function in to ``nbytes`` of dynamic shared memory (only when it grows: the
        attribute is a maximum, and every launcher of this kernel goes through here)."""
        if nbytes > self._max_dyn_smem:
            set_max_dynamic_smem(self.function, int(nbytes))
            self._max_dyn_smem = int(nbytes)

    def launch(self, launch, args, *, stream=None) -> None:
        """Launch with a :class:`~qmoe_rtc.jit.family.Launch` geometry."""
        self(launch.grid, launch.block, args, shared_mem=launch.shared_mem, stream=stream)

    def __repr__(self) -> str:
        return f"Kernel({self.module_name}:{self.kdef.key})"
