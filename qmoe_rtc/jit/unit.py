"""A compile unit: everything NVRTC is given for one module, and the key that hashes all of it.

The machinery compiles and caches units; it knows no kernel family and no layout. Whoever builds a
unit (a kernel family) puts every code-shaping choice into its source or its defines, so the key,
which hashes the whole unit plus the toolchain, cannot miss one.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import astuple, dataclass, replace

from ..errors import CompileError
from . import compiler
from .args import KernelDef

__all__ = ["SCHEMA_VERSION", "CompileUnit", "unit_key"]

#: Bump when the entry format or key composition changes (3: a digest over every metadata field).
SCHEMA_VERSION = 3


@dataclass(frozen=True)
class CompileUnit:
    """One module to compile.

    ``name``: readable module name (file names, logs); ``source``: the generated translation unit;
    ``kernels``: its entries (name expressions + argument specs); ``defines``: extra NVRTC options
    (``-D...`` only: an include path would hide files from the key); ``meta``: ``(name, value)``
    pairs written into the disk entry's JSON for people (the key does not need them: the source
    and defines already say everything); ``parts``: the kernel keys of each NVRTC program when the
    module is built as several (empty: one program), see :meth:`pieces`.
    """

    name: str
    source: str
    kernels: tuple[KernelDef, ...]
    defines: tuple[str, ...] = ()
    meta: tuple = ()
    parts: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        for d in self.defines:
            if not d.startswith("-D"):
                raise CompileError(self.name, f"unit option {d!r}: only -D defines are allowed (anything else could "
                                              "change the code without changing the key)", self.defines)
        if self.parts:
            keys = [k.key for k in self.kernels]
            listed = [key for part in self.parts for key in part]
            if any(not part for part in self.parts) or sorted(listed) != sorted(keys):
                raise CompileError(self.name, f"parts {self.parts!r} must name each of the kernels {keys} exactly "
                                              "once, in non-empty parts", self.defines)

    def pieces(self) -> tuple[CompileUnit, ...]:
        """The units NVRTC compiles: this one, or one per part (``<name>.p<i>``: the same source and
        defines, the part's kernels). NVRTC instantiates only the kernels a program names, so each piece
        holds its part's kernels, and ptxas compiles each kernel alone, so a kernel's machine code does not
        depend on the grouping (but under NVVM's split, which partitions a program's kernels: there a
        kernel alone gets the unsplit code). The cache keeps a piece like any unit; the pieces compile side
        by side (:func:`qmoe_rtc.jit.get_cubins`) and load as one module."""
        if len(self.parts) < 2:
            return (self,)
        n = len(self.parts)
        return tuple(replace(self, name=f"{self.name}.p{i}", kernels=tuple(self.kernel(key) for key in part),
                             meta=(*self.meta, ("part", f"{i + 1}/{n}")), parts=())
                     for i, part in enumerate(self.parts))

    def name_exprs(self) -> dict[str, str]:
        return {k.key: k.name_expr for k in self.kernels}

    def kernel(self, key: str) -> KernelDef:
        for k in self.kernels:
            if k.key == key:
                return k
        raise KeyError(f"module {self.name} has no kernel {key!r} (has {[k.key for k in self.kernels]})")


def _field(h, label: str, value: str) -> None:
    data = value.encode()
    h.update(f"{label}:{len(data)}:".encode())
    h.update(data)
    h.update(b"\n")


@functools.lru_cache(maxsize=512)
def _kernels_json(kernels: tuple[KernelDef, ...]) -> str:
    """The kernels' keys, name expressions and argument specs as JSON (memoised: ``astuple`` walks every
    argument, ~0.5 ms a module, and every plan computes its modules' keys)."""
    return json.dumps([[k.key, k.name_expr, [[type(a).__name__, *astuple(a)] for a in k.args]] for k in kernels],
                      separators=(",", ":"))


def unit_key(unit: CompileUnit, arch: str) -> str:
    """sha256 over labeled, length-prefixed fields: schema, the unit (name, source, name expressions,
    argument specs), every file under cuda_src, the CUDA headers used, the NVRTC version, the exact
    options (knob-driven ones included; include paths as labels), the arch (as compiled: an alias
    such as 'sm_90' keys like the target it names) and the parts, when there are some."""
    arch = compiler.check_arch(arch)
    h = hashlib.sha256()
    _field(h, "schema", str(SCHEMA_VERSION))
    _field(h, "name", unit.name)
    _field(h, "source", unit.source)
    _field(h, "kernels", _kernels_json(unit.kernels))
    _field(h, "cuda_src", compiler.cuda_src_digest())
    _field(h, "cuda_headers", compiler.cuda_headers_digest())
    _field(h, "nvrtc", "{}.{}".format(*compiler.nvrtc_version()))
    _field(h, "options", "\0".join(compiler.key_options(compiler.base_options(arch, unit.defines))))
    _field(h, "arch", arch)
    if unit.parts:  # a unit built as one program keeps the key it had before parts existed
        _field(h, "parts", json.dumps(unit.parts, separators=(",", ":")))
    return h.hexdigest()
