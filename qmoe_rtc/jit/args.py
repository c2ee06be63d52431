"""Kernel argument specs and their packing: what a ``__global__`` function takes, by name and C type.

A :class:`KernelDef` names one kernel of a module (its NVRTC name expression) and lists its
parameters as :class:`Ptr` (a device pointer, with the dtype it must point to), :class:`Scalar`
(a by-value argument packed as its declared C type) and :class:`Struct` (a C++ struct passed by
value, whose members are again Ptr, Scalar or Struct). Values are bound by the leaf names (the
Ptr and Scalar names, structs flattened in declaration order). :class:`ParamBlock` lays the values
out as the C++ compiler does (natural alignment, structs padded to their alignment) and builds the
``void**`` array ``cuLaunchKernel`` reads, once; a caller may then overwrite chosen pointer leaves
between launches (the per-call input and output) without repacking anything else.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .._arrays import dtype_name, is_c_contiguous, is_cupy, shape_str
from ..errors import DeviceError, QMoEAttributeError, QMoEInputError

__all__ = ["CTYPES", "KernelDef", "Launch", "ParamBlock", "Ptr", "Scalar", "Struct", "check_pointer", "leaves",
           "pack_value", "param_layout"]

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
class Struct:
    """A struct parameter passed by value: ``ctype`` is the C++ struct's name (without namespace or
    template arguments, e.g. ``"Proj"``), ``fields`` its members in declaration order. The C++
    declaration is the single source of the order; a CPU test reads it (tests/kernels/test_kernel_args.py)."""

    name: str
    ctype: str
    fields: tuple

    def __post_init__(self) -> None:
        if not self.fields:
            raise QMoEAttributeError(f"Struct({self.name}).fields", "at least one member", "none")


def leaves(specs) -> tuple:
    """The Ptr and Scalar specs of ``specs`` in order, structs flattened (what values are bound to)."""
    out = []
    for a in specs:
        out.extend(leaves(a.fields) if isinstance(a, Struct) else (a,))
    return tuple(out)


def _size_align(spec) -> tuple[int, int]:
    if isinstance(spec, Ptr):
        return 8, 8
    if isinstance(spec, Scalar):
        n = np.dtype(CTYPES[spec.ctype]).itemsize
        return n, n
    _, size, align = _members(spec.fields)
    return size, align


def _members(specs) -> tuple[list, int, int]:
    """``([(spec, offset)], size, align)`` of a member list laid out as C does (the size padded to the
    alignment, as a struct's is)."""
    out, off, align = [], 0, 1
    for a in specs:
        n, al = _size_align(a)
        off = -(-off // al) * al
        out.append((a, off))
        off += n
        align = max(align, al)
    return out, -(-off // align) * align, align


def param_layout(kdef_args) -> tuple[list[int], list[tuple], int]:
    """Where each parameter and each leaf lies in one buffer laid out like the kernel's parameter
    space: ``(parameter offsets, [(leaf spec, offset)], size)`` in bytes."""
    tops, size, _ = _members(kdef_args)
    flat = []

    def walk(spec, off):
        if isinstance(spec, Struct):
            for m, o in _members(spec.fields)[0]:
                walk(m, off + o)
        else:
            flat.append((spec, off))

    for a, o in tops:
        walk(a, o)
    return [o for _, o in tops], flat, size


@dataclass(frozen=True)
class KernelDef:
    """One ``__global__`` entry of a module: ``key`` (Python-side name), the C++ name expression
    handed to nvrtcAddNameExpression, and the argument specs in order."""

    key: str
    name_expr: str
    args: tuple  # the __global__ function's parameters: Ptr, Scalar, Struct

    @functools.cached_property
    def block_layout(self) -> tuple[tuple[int, ...], tuple, int, tuple[str, ...]]:
        """:func:`param_layout` as tuples plus the leaf names, worked out once per kernel definition (a plan
        packs each of its launches; laying the specs out again each time was ~40 % of packing one)."""
        tops, flat, size = param_layout(self.args)
        return tuple(tops), tuple(flat), size, tuple(spec.name for spec, _ in flat)

    def arg_names(self) -> tuple[str, ...]:
        """The leaf names, structs flattened: what a launch binds (and a positional call passes) in order."""
        return tuple(a.name for a in leaves(self.args))


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

    ``values`` is one buffer of 8-byte words laid out like the kernel's parameter space
    (:func:`param_layout`); pointers are 8-byte aligned, so each pointer leaf is one word, and
    ``word(name)`` says which. ``address`` is the ``void**`` (one pointer per parameter, into the
    buffer) to hand to ``cuLaunchKernel``. A launcher may overwrite a pointer leaf (``values[w] =
    address``, or :meth:`set_pointer`) between launches; the driver copies parameters at launch, so
    a word may change right after a launch returns.
    """

    __slots__ = ("values", "_ptrs", "_words", "address", "names")

    def __init__(self, kdef: KernelDef, values: dict, device_id: int | None = None):
        tops, flat, size, self.names = kdef.block_layout
        self.values = np.zeros(max(-(-size // 8), 1), dtype=np.uint64)  # [ceil(size/8)] parameter space
        raw = self.values.view(np.uint8)
        if len(set(self.names)) != len(self.names):
            dup = sorted({n for n in self.names if self.names.count(n) > 1})
            raise QMoEAttributeError(f"{kdef.key} arguments", "distinct leaf names (values bind by name)", str(dup))
        self._words = {}
        for spec, off in flat:
            where = f"{kdef.key}.{spec.name}"
            if spec.name not in values:
                raise QMoEInputError(where, "a bound value", "nothing (no binding of that name)")
            v = values[spec.name]
            if isinstance(spec, Ptr):
                self.values[off // 8] = v if isinstance(v, (int, np.integer)) else check_pointer(where, spec, v, device_id)
                self._words[spec.name] = off // 8
            else:
                packed = pack_value(where, spec, v)
                raw[off : off + packed.nbytes] = np.frombuffer(packed.tobytes(), dtype=np.uint8)
        base = self.values.ctypes.data
        self._ptrs = (base + np.asarray(tops or [0], dtype=np.uint64)).astype(np.uint64)  # [parameters] void*
        self.address = int(self._ptrs.ctypes.data)

    def word(self, name: str) -> int:
        """The index in ``values`` of pointer leaf ``name``."""
        return self._words[name]

    def set_pointer(self, name: str, address: int) -> None:
        self.values[self._words[name]] = address

    def value(self, name: str) -> int:
        return int(self.values[self._words[name]])
