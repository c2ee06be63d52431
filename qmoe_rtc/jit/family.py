"""What a kernel family declares: header, layout dependencies, kernels with argument specs, the
generated translation unit and launch geometry. Subclass :class:`KernelFamily` in a module under
``qmoe_rtc/kernels/`` (see docs/runtime-compilation.md, "Adding a family").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

from ..errors import QMoEAttributeError

__all__ = ["Ptr", "Scalar", "Arg", "KernelDef", "Launch", "KernelFamily", "CTYPES", "CPP_TYPES"]

#: Scalar C types a kernel argument may declare, and the NumPy type each is packed as.
CTYPES = {
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float32": "float32",
    "float64": "float64",
}

#: C++ spelling of our dtype names inside templates.
CPP_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "uint8": "qmoe::u8",
             "int32": "qmoe::i32", "int64": "qmoe::i64", "uint32": "qmoe::u32"}


@dataclass(frozen=True)
class Ptr:
    """A device-pointer argument: a C-contiguous CuPy array of ``dtype`` (None = any dtype).

    ``nullable``: ``None`` is accepted and passed as a null pointer.
    A ``bfloat16`` pointer also accepts a ``uint16`` array (CuPy builds without bfloat16).
    """

    name: str
    dtype: str | None
    nullable: bool = False


@dataclass(frozen=True)
class Scalar:
    """A by-value argument packed as the declared C type (``int32``, ``int64``, ``float32`` ...)."""

    name: str
    ctype: str

    def __post_init__(self) -> None:
        if self.ctype not in CTYPES:
            raise QMoEAttributeError(f"Scalar({self.name}).ctype", f"one of {list(CTYPES)}", repr(self.ctype))


Arg = Ptr | Scalar


@dataclass(frozen=True)
class KernelDef:
    """One ``__global__`` entry of a module: ``key`` (Python-side name), the C++ name expression
    handed to nvrtcAddNameExpression (its lowered name is stored with the cubin) and the argument
    spec, in order."""

    key: str
    name_expr: str
    args: tuple

    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


@dataclass(frozen=True)
class Launch:
    grid: tuple
    block: tuple
    shared_mem: int = 0


class KernelFamily:
    """Base class of a kernel family. Class attributes to set:

    - ``name``: registry name (also the module-name prefix), e.g. ``"dequant"``.
    - ``header``: the template header under ``cuda_src/`` the unit includes.
    - ``depends_on``: the :class:`~qmoe_rtc.specialize.Layout` fields that shape this family's code.
      Layers differing only in other fields share modules (a test checks both directions).
    - ``variants``: execution variants needing the family (None = always).

    Methods to implement: :meth:`kernels`, :meth:`launch`; override :meth:`specs` when one layout
    needs several modules (dequant: one per projection), :meth:`source` for units that are more
    than "include the header; instantiate through name expressions", :meth:`defines` for -D macros.
    """

    name: ClassVar[str] = ""
    header: ClassVar[str] = ""
    depends_on: ClassVar[tuple[str, ...]] = ()
    variants: ClassVar[tuple[str, ...] | None] = None

    # -- which modules ---------------------------------------------------------------------
    def specs(self, config: Any, variants: Iterable[str]) -> list:
        """Module specs a layer needs. Default: one spec from the ``depends_on`` fields."""
        from ..specialize import ModuleSpec

        layout = getattr(config, "layout", config)
        return [ModuleSpec.make(self.name, **{f: getattr(layout, f) for f in self.depends_on})]

    # -- code ------------------------------------------------------------------------------
    def kernels(self, spec) -> tuple[KernelDef, ...]:
        raise NotImplementedError(f"kernel family {self.name!r} must define kernels()")

    def defines(self, spec) -> tuple[str, ...]:
        """Extra ``-D`` options (they are part of the options, hence of the cache key)."""
        return ()

    def source(self, spec) -> str:
        """The generated translation unit (~15 lines): include the header; NVRTC instantiates the
        templates named by the kernels' name expressions."""
        lines = [
            f"// qmoe_rtc generated unit: family {self.name}, module {spec.name}",
            f"// params: {', '.join(f'{k}={v}' for k, v in spec.params)}",
            f'#include "{self.header}"',
            "// kernels (instantiated through NVRTC name expressions):",
        ]
        lines += [f"//   {k.key}: {k.name_expr}" for k in self.kernels(spec)]
        return "\n".join(lines) + "\n"

    # -- launch ----------------------------------------------------------------------------
    def launch(self, spec, kernel: str, **problem: Any) -> Launch:
        raise NotImplementedError(f"kernel family {self.name!r} must define launch()")
