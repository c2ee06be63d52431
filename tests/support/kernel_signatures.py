"""A compiled kernel's C++ parameter list against its argument specs (``jit.KernelDef``): the launch packs
the arguments in the specs' order, so a spec list out of step with the ``__global__`` signature would pass
pointers as integers or shift every argument after the slip. NVRTC's lowered (mangled) name of a
kernel carries its parameter types; demangled, they are compared one by one with the specs: a pointer
to the spec's dtype for a ``Ptr`` (any pointer for ``Ptr(dtype=None)``), the scalar type for a
``Scalar``, the struct's name for a ``Struct`` (its members are checked against the declaration in
cuda_src/core/args.cuh by tests/kernels/test_kernel_args.py). Names cannot be compared this way (mangling drops
them); order, count and types can."""

from __future__ import annotations

import ctypes
import ctypes.util
import shutil
import subprocess

from qmoe_rtc.jit import Ptr, Scalar, Struct

#: The C++ spelling (as the demangler prints it) of each dtype name the specs use.
C_TYPES = {
    "float16": ("__half",), "bfloat16": ("__nv_bfloat16",), "float32": ("float",), "uint8": ("unsigned char",),
    "int8": ("signed char",), "int32": ("int",), "uint32": ("unsigned int",), "int64": ("long", "long long"),
    "uint64": ("unsigned long", "unsigned long long"),
}


def demangle(name: str) -> str:
    """The demangled form of an Itanium C++ name (libstdc++'s ``__cxa_demangle``, else ``c++filt``)."""
    path = ctypes.util.find_library("stdc++")
    if path:
        lib, libc = ctypes.CDLL(path), ctypes.CDLL(None)
        fn = lib.__cxa_demangle
        fn.restype = ctypes.c_void_p
        status = ctypes.c_int()
        ptr = fn(name.encode(), None, None, ctypes.byref(status))
        if status.value == 0 and ptr:
            try:
                return ctypes.string_at(ptr).decode()
            finally:
                libc.free(ctypes.c_void_p(ptr))
    if shutil.which("c++filt"):
        return subprocess.run(["c++filt", name], capture_output=True, text=True, check=True).stdout.strip()
    raise RuntimeError(f"no C++ demangler here (libstdc++ or c++filt) to read {name}")


def parameters(demangled: str) -> list[str]:
    """The parameter types of a demangled function name ``void ns::f<...>(A, B const*, ...)``, in order."""
    depth, start = 0, None
    for i, ch in enumerate(demangled):  # the parameter list: the parenthesis after the template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            start = i + 1
            break
    if start is None or not demangled.endswith(")"):
        raise ValueError(f"not a function signature: {demangled}")
    out, depth, cur = [], 0, ""
    for ch in demangled[start:-1]:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _matches(spec, ctype: str) -> bool:
    if isinstance(spec, Ptr):
        if not ctype.endswith("*"):
            return False
        pointee = ctype[:-1].strip().removesuffix("const").strip()
        return spec.dtype is None or pointee in C_TYPES[spec.dtype]
    if isinstance(spec, Scalar):
        return ctype in C_TYPES[spec.ctype]
    if isinstance(spec, Struct):  # 'qmoe::Proj<__half>' -> 'Proj'
        return ctype.split("<")[0].split("::")[-1].strip() == spec.ctype
    raise TypeError(f"an argument spec is a Ptr, a Scalar or a Struct, not {type(spec).__name__}")


def mismatches(kernel, lowered: str) -> list[str]:
    """Where ``kernel``'s (a ``KernelDef``) argument specs and the parameters of its compiled entry
    ``lowered`` (the mangled name) disagree; empty when they agree."""
    sig = demangle(lowered)
    types = parameters(sig)
    out = []
    if len(types) != len(kernel.args):
        out.append(f"{kernel.key}: {len(kernel.args)} argument specs, {len(types)} parameters in {sig}")
    for i, (spec, ctype) in enumerate(zip(kernel.args, types)):
        if not _matches(spec, ctype):
            want = f"{type(spec).__name__}({getattr(spec, 'dtype', None) or getattr(spec, 'ctype', None)})"
            out.append(f"{kernel.key} argument {i} '{spec.name}': spec {want}, parameter '{ctype}'")
    return out
