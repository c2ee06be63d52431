"""What a kernel family is: it owns its kernels completely -- the module spec a layout needs, the
generated translation unit, argument specs by name, and per pipeline step (role) the kernel, launch
geometry, scratch it needs and the limits it has (:meth:`KernelFamily.supports`).

The executor never restates any of that: it binds every argument by its name from one table.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import ClassVar

from ..errors import QMoEUnsupportedError
from ..jit import CompileUnit, KernelDef, Launch
from ..settings import knobs
from ..specialize import ModelConfig, ModuleSpec
from .arch import ArchSpec

__all__ = ["BUILTIN_FAMILIES", "KernelFamily", "Problem", "Slot", "family_names", "get_family", "register", "spec_unit",
           "unregister"]


@dataclass(frozen=True)
class Problem:
    """One call's sizes and dtypes, as the kernels see them.

    ``E`` / ``k``: the routed experts and top-k. With ``shared`` = S shared experts [ext], routing
    writes ``slots`` = k + S routes per token (slots k..k+S-1 are the shared experts, ids E..E+S-1,
    weight 1 or the sigmoid gate), so the expert engines see ``experts`` = E + S experts and
    ``routes`` = rows·(k + S) routes. ``router_gemm``: the dtype of ``router_weight`` when the layer
    computes its logits from the input [ext] ('' when the call passes them). ``all_experts``: with an
    expert slice [ext] the layer holds E of the whole layer's ``all_experts`` experts; routing picks
    from all of them and writes -1 for a route to an expert not held, which the engines skip.
    """

    rows: int
    E: int
    H: int
    I: int  # noqa: E741
    k: int
    dtype: str
    router_dtype: str = "float32"
    router_weights_dtype: str | None = None
    sparse: bool = False
    arch: str = ""  # the device's compile target ('sm_90a' ...); '' when unknown (warm tool, CPU)
    shared: int = 0  # S shared experts [ext]
    shared_gate: bool = False  # their sum is scaled by sigmoid(x·shared_gate_weight)
    router_gemm: str = ""  # router_weight's dtype when the layer computes the logits ('' : passed in)
    all_experts: int = 0  # expert slices [ext]: the whole layer's E, which routing picks from (0: E)
    sms: int = 0  # the device's multiprocessors (0 when unknown: warm tool, CPU tests; see sm_count)
    smem: int = 0  # the device's opt-in dynamic shared memory per block, bytes (0 when unknown: see smem_limit)
    sigmoid_routing: bool = False  # grouped sigmoid routing [ext] (routing/route_grouped.cuh)
    expert_counts: bool = False  # routing adds each pick to the layer's expert statistics [ext]

    @classmethod
    def for_config(cls, config, rows: int, **call) -> Problem:
        """The problem of a call of ``rows`` tokens to a layer of ``config``
        (:class:`~qmoe_rtc.specialize.ModelConfig`): its sizes, dtype and [ext] parts from the config, the rest
        (``arch``, ``sms``, ``smem``, the router dtypes) from ``call``."""
        return cls(rows=rows, E=config.experts, H=config.hidden, I=config.inter, k=config.k, dtype=config.layout.dtype,
                   sparse=config.use_sparse_mixer, shared=config.shared, shared_gate=config.shared_gate,
                   router_gemm=config.router_gemm, all_experts=config.all_experts,
                   sigmoid_routing=config.scoring_func == "sigmoid",
                   expert_counts=bool(getattr(config, "expert_counts", False)), **call)

    @property
    def device(self) -> ArchSpec:
        """The device the call runs on (kernels/arch.py): its target, SMs and shared memory."""
        return ArchSpec(self.arch, self.sms, self.smem)

    @property
    def sm_count(self) -> int:
        """Multiprocessors the launch-geometry rules size grids for: the device's (the executor reads it
        from the GPU), else :data:`~qmoe_rtc.kernels.arch.DEFAULT_SMS`."""
        return self.device.sm_count

    @property
    def smem_limit(self) -> int:
        """Dynamic shared memory a launch of this problem may ask a block for: the device's opt-in limit (the
        executor reads it from the GPU), else the arch's (:attr:`ArchSpec.smem_limit`)."""
        return self.device.smem_limit

    @property
    def logit_count(self) -> int:
        """Router logits per token: the whole layer's experts (a slice holds E of them)."""
        return self.all_experts or self.E

    @property
    def slots(self) -> int:
        """Routes per token: the k routed ones, then the S shared experts."""
        return self.k + self.shared

    @property
    def experts(self) -> int:
        """Experts the engines address: the E routed ones, then the S shared ones."""
        return self.E + self.shared

    @property
    def routes(self) -> int:
        return self.rows * self.slots


@dataclass(frozen=True)
class Slot:
    """A scratch buffer a step needs: ``nbytes`` (grown to the largest asked for), zeroed once at
    allocation when ``zero`` (kernels that use it return it to zero)."""

    nbytes: int
    zero: bool = False


class KernelFamily:
    """Base class. Class attributes: ``name`` (registry name, module-name prefix), ``header`` (the
    template under ``cuda_src/`` the unit includes), ``depends_on`` (the :class:`~qmoe_rtc.specialize.Layout`
    fields that shape this family's code; a test checks both directions).

    To implement: :meth:`specs` (or :meth:`spec`), :meth:`kernels`; for pipeline steps
    :meth:`kernel_for`, :meth:`launch`, :meth:`scratch`, :meth:`supports`. Optional: :meth:`defines`
    (-D options), :meth:`decisions` (the host's choices the device code reads from the generated unit),
    :meth:`source` (the generated unit, default: the decisions, then include the header; NVRTC
    instantiates the templates named by the name expressions), :attr:`solo` / :meth:`parts` (the
    module as several NVRTC programs compiled side by side).
    """

    name: ClassVar[str] = ""
    header: ClassVar[str] = ""
    depends_on: ClassVar[tuple[str, ...]] = ()
    #: True when whether this family runs depends on the call or the device (supports() / slower()
    #: look at the problem): the warm tool then also compiles the pipelines after it.
    conditional: ClassVar[bool] = False
    #: Key prefixes of the kernels NVRTC compiles as programs of their own (the rest share one), side by
    #: side: a module's compile then takes about as long as its largest kernel (:meth:`parts`).
    solo: ClassVar[tuple[str, ...]] = ()

    # -- which modules ---------------------------------------------------------------------
    def spec(self, config: ModelConfig) -> ModuleSpec:
        layout = getattr(config, "layout", config)
        return ModuleSpec.make(self.name, **{f: getattr(layout, f) for f in self.depends_on})

    def specs(self, config: ModelConfig) -> list[ModuleSpec]:
        """Every module this family has for a layer (the warm tool compiles them all)."""
        return [self.spec(config)]

    def supports(self, config: ModelConfig, problem: Problem | None = None) -> str | None:
        """None when this family runs ``config`` (at ``problem``, when given), else the reason it cannot."""
        return None

    def slower(self, config: ModelConfig, problem: Problem | None = None) -> str | None:
        """None unless a later pipeline is known to be faster at ``problem`` (then why): the choice passes
        this family over without a warning (it is a measured preference, not a limit)."""
        return None

    # -- code ------------------------------------------------------------------------------
    def kernels(self, spec: ModuleSpec) -> tuple[KernelDef, ...]:
        raise NotImplementedError(f"kernel family {self.name!r} must define kernels()")

    def defines(self, spec: ModuleSpec) -> tuple[str, ...]:
        return ()

    def decisions(self, spec: ModuleSpec) -> tuple[str, ...]:
        """Lines of the generated unit ahead of the header: what the host decided for the module's kernels (ring
        depths, warpgroups, launch bounds ...) as the device code reads it, which only checks it (static_assert)
        instead of deciding again. () by default."""
        return ()

    def source(self, spec: ModuleSpec) -> str:
        lines = [
            f"// qmoe_rtc generated unit: family {self.name}, module {spec.name}",
            f"// params: {', '.join(f'{k}={v}' for k, v in spec.params)}",
            *self.decisions(spec),
            f'#include "{self.header}"',
            "// kernels (instantiated through NVRTC name expressions):",
        ]
        lines += [f"//   {k.key}: {k.name_expr}" for k in self.kernels(spec)]
        return "\n".join(lines) + "\n"

    def parts(self, spec: ModuleSpec) -> tuple[tuple[str, ...], ...]:
        """The kernel keys of each NVRTC program the module is built from (:attr:`solo`: each such kernel
        alone, then the others together; () when that makes one program, or with knob ``compile_parts``
        0). Only the grouping changes: NVRTC instantiates the kernels a program names, ptxas compiles each
        kernel alone (NVVM's split, tuning knob ``split_compile`` ``all``, partitions a program's kernels: a kernel
        alone gets the unsplit code)."""
        if not self.solo or not knobs.get("compile_parts"):
            return ()
        keys = [k.key for k in self.kernels(spec)]
        alone = tuple((key,) for key in keys if key.startswith(self.solo))
        rest = tuple(key for key in keys if not key.startswith(self.solo))
        parts = alone + ((rest,) if rest else ())
        return parts if len(parts) > 1 else ()

    def unit(self, spec: ModuleSpec) -> CompileUnit:
        """The compile unit of ``spec``: everything that shapes its code is in its source or defines."""
        return CompileUnit(name=spec.name, source=self.source(spec), kernels=self.kernels(spec),
                           defines=tuple(self.defines(spec)), meta=(("family", self.name), *spec.params),
                           parts=self.parts(spec))

    # -- pipeline steps --------------------------------------------------------------------
    def configure(self, spec: ModuleSpec, problem: Problem):
        """The family's choices for one call (route tile, splits, pairs ...), made once per plan: a frozen value the
        plan hands to :meth:`kernel_for`, :meth:`launch` and :meth:`scratch` as ``call``, so they read one decision
        instead of each making it again; None where the family has none to share. Each of those methods computes it
        when given none (tests call them one at a time)."""
        return None

    def kernel_for(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> str:
        """The kernel key that does ``role`` for ``problem``."""
        return role

    def launch(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> Launch:
        raise NotImplementedError(f"kernel family {self.name!r} has no step {role!r}")

    def scratch(self, spec: ModuleSpec, role: str, problem: Problem, call=None) -> dict[str, Slot]:
        """Scratch buffers (by argument name) the step reads or writes."""
        return {}


# -- registry ----------------------------------------------------------------------------------

#: Built-in families, imported lazily on first lookup (nothing is imported at package import).
BUILTIN_FAMILIES: tuple[str, ...] = ("dequant", "route", "gemv", "mma_decode", "gemm", "mma_batched", "mma_prefill",
                                      "wgmma_prefill", "act_quant")

_lock = threading.RLock()
_registry: dict[str, KernelFamily] = {}
_extra: list[str] = []


def register(cls):
    """Class decorator: register one instance of a KernelFamily subclass under ``cls.name``."""
    with _lock:
        if not cls.name or not cls.header:
            raise QMoEUnsupportedError(f"kernel family {cls.__name__} must set 'name' and 'header'")
        prev = _registry.get(cls.name)
        if prev is not None and type(prev).__qualname__ != cls.__qualname__:
            raise QMoEUnsupportedError(f"kernel family name {cls.name!r} already registered by {type(prev).__name__}")
        _registry[cls.name] = cls()
        if cls.name not in BUILTIN_FAMILIES and cls.name not in _extra:
            _extra.append(cls.name)
    return cls


def unregister(name: str) -> None:
    """Remove a non-built-in family (tests that register throw-away families)."""
    with _lock:
        if name in BUILTIN_FAMILIES:
            raise QMoEUnsupportedError(f"built-in kernel family {name!r} cannot be unregistered")
        _registry.pop(name, None)
        if name in _extra:
            _extra.remove(name)


def get_family(name: str) -> KernelFamily:
    """The registered family ``name`` (importing ``qmoe_rtc.kernels.<name>`` on first use)."""
    with _lock:
        fam = _registry.get(name)
        if fam is None and name in BUILTIN_FAMILIES:
            importlib.import_module(f"{__package__}.{name}")
            fam = _registry.get(name)
        if fam is None:
            raise QMoEUnsupportedError(f"unknown kernel family {name!r} (known: {list(family_names())})")
        return fam


def family_names() -> tuple[str, ...]:
    with _lock:
        return BUILTIN_FAMILIES + tuple(_extra)


def spec_unit(spec: ModuleSpec) -> CompileUnit:
    """The compile unit of a module spec, by its family."""
    return get_family(spec.family).unit(spec)
