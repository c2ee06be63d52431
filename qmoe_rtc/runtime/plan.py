"""A plan: one pipeline bound to loaded kernels for one problem, and its launches bound to a scratch pool.

``Plan`` is made outside capture (it may compile and load). ``Plan.bind(pool, ...)`` packs every
launch's parameters once, binding each kernel argument by its name from one table (layer tensors
and attributes, problem sizes, the family's launch scalars, scratch addresses); the per-call
arrays (:data:`PER_CALL`) are pointer slots a call overwrites. ``BoundLaunches.launch`` only writes
those slots and calls ``cuLaunchKernel`` (``cuLaunchKernelEx`` for a launch that overlaps its
predecessor, see :func:`overlap_allowed`): no allocation, no sync, capture-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DeviceError
from ..jit import Kernel, Launch, LoadedModule, driver, load_modules
from ..jit.driver import _drv
from ..kernels import Pipeline, Problem, Slot, get_family
from ..kernels.arch import ArchSpec
from ..settings import knobs
from ..specialize import ModuleSpec

__all__ = ["PER_CALL", "BoundLaunches", "Plan", "PlanStep", "launched", "load_launched", "overlap_allowed",
           "problem_scalars"]

#: Arguments that change with every call, in the order a call passes their addresses.
PER_CALL = ("x", "logits", "router_weights", "out")


def overlap_allowed(arch: str) -> bool:
    """Whether launches that declare ``overlap`` run overlapped (programmatic dependent launch) on a
    device compiled for ``arch`` ('sm_90a' ...): sm_90 and newer, unless the ``pdl`` knob is off."""
    return ArchSpec(arch).pdl and bool(knobs.get("pdl"))


def problem_scalars(p: Problem) -> dict:
    """The problem sizes every kernel may take by name. The expert engines see E + S experts and
    k + S routes per token (shared experts [ext] are routes); routing takes the routed E and k, and
    the router logits per token (the whole layer's E, for an expert slice [ext])."""
    return dict(rows=p.rows, R=p.routes, E=p.experts, H=p.H, I=p.I, k=p.slots, E_routed=p.E, k_routed=p.k, S=p.shared,
                E_logits=p.logit_count)


def launched(pipeline: Pipeline, specs: dict, config, problem: Problem) -> dict[ModuleSpec, set[str]]:
    """The kernel keys ``pipeline``'s steps launch at ``problem``, by module spec (``specs``: each family's); a family
    none of whose steps runs at ``problem`` (the routing, where the group step routes) has no entry: nothing of it
    is loaded."""
    out: dict[ModuleSpec, set[str]] = {}
    calls = _calls(pipeline, specs, config, problem)
    for st in pipeline.steps_for(config, problem):
        spec = specs[st.family]
        out.setdefault(spec, set()).add(get_family(st.family).kernel_for(spec, st.role, problem, calls[st.family]))
    return out


def _calls(pipeline: Pipeline, specs: dict, config, problem: Problem) -> dict:
    """Each family's choices for the call (:meth:`~qmoe_rtc.kernels.base.KernelFamily.configure`), made once."""
    return {f: get_family(f).configure(specs[f], problem) for f in dict.fromkeys(st.family for st in
                                                                                 pipeline.steps_for(config, problem))}


def load_launched(wanted, device_id: int) -> dict[ModuleSpec, LoadedModule]:
    """The modules of every :func:`launched` dict in ``wanted``, loaded in one batch: a module built in parts
    loads only the pieces holding the kernels named (a plan needs one route tile's GEMMs, not every tile's),
    all of them compiled side by side (QMoE.reserve: every size's at once)."""
    merged: dict[ModuleSpec, set[str]] = {}
    for want in wanted:
        for spec, keys in want.items():
            merged[spec] = merged.get(spec, set()) | keys
    specs = list(merged)
    return dict(zip(specs, load_modules([get_family(s.family).unit(s) for s in specs], device_id,
                                        [merged[s] for s in specs])))


@dataclass(frozen=True)
class PlanStep:
    family: str
    role: str
    spec: ModuleSpec
    kernel: Kernel
    launch: Launch
    scratch: dict


class Plan:
    """The kernels, geometry and scratch of one (problem, pipeline)."""

    def __init__(self, problem: Problem, pipeline: Pipeline, steps: tuple[PlanStep, ...]):
        self.problem = problem
        self.pipeline = pipeline
        self.steps = steps
        needs: dict[str, Slot] = {}
        for st in steps:
            for name, slot in st.scratch.items():
                old = needs.get(name)
                needs[name] = slot if old is None else Slot(max(old.nbytes, slot.nbytes), old.zero or slot.zero)
        self.needs = needs
        self._bound: dict[int, BoundLaunches] = {}  # id(pool) -> launches bound to that pool

    @classmethod
    def build(cls, config, problem: Problem, pipeline: Pipeline, specs: dict, modules: dict) -> Plan:
        """The plan of ``pipeline`` at ``problem``: each step's kernel from ``modules`` (by spec, loaded with the
        kernels :func:`launched` names), its family's launch geometry and scratch."""
        steps = []
        calls = _calls(pipeline, specs, config, problem)
        for st in pipeline.steps_for(config, problem):
            fam, spec, call = get_family(st.family), specs[st.family], calls[st.family]
            steps.append(PlanStep(st.family, st.role, spec, modules[spec][fam.kernel_for(spec, st.role, problem, call)],
                                  fam.launch(spec, st.role, problem, call), fam.scratch(spec, st.role, problem, call)))
        return cls(problem, pipeline, tuple(steps))

    @property
    def engine(self) -> str:
        return self.pipeline.name

    def bind(self, pool, table: dict, stream: int) -> BoundLaunches:
        """Launches bound to ``pool`` (grown first if needed: refused inside capture), reused while
        the pool keeps its buffers."""
        b = self._bound.get(id(pool))
        if b is None or b.generation != pool.generation:
            pool.ensure(self.needs, stream)
            b = BoundLaunches(self, pool, table)
            self._bound[id(pool)] = b
        return b


class BoundLaunches:
    """The packed launches of a plan on one pool."""

    __slots__ = ("_launch", "_ok", "generation", "graphed", "items", "overlapped", "pool")

    def __init__(self, plan: Plan, pool, table: dict):
        p = plan.problem
        base = dict(table)
        base.update(problem_scalars(p))
        base.update({name: pool.address(name) for name in pool.bufs})
        base.update(dict.fromkeys(PER_CALL, 0))
        overlap_ok = overlap_allowed(p.arch)
        items, overlapped = [], []
        for i, st in enumerate(plan.steps):
            values = {**base, **dict(st.launch.args)}
            params = st.kernel.pack(values)
            slots = tuple((params.word(n), PER_CALL.index(n)) for n in params.names if n in PER_CALL)
            st.kernel.reserve_dynamic_smem(st.launch.shared_mem)
            g, b = st.launch.grid, st.launch.block
            items.append((st.kernel.function, int(g[0]), int(g[1]), int(g[2]), int(b[0]), int(b[1]), int(b[2]),
                          int(st.launch.shared_mem), params.values, params.address, slots, st.kernel, params))
            # the first launch always waits for whatever the stream ran before the forward
            overlapped.append(driver.launch_config(g, b, st.launch.shared_mem, True)
                              if overlap_ok and i > 0 and st.launch.overlap else None)
        self.items = tuple(items)
        self.overlapped = tuple(overlapped)  # per item: its CUlaunchConfig when launched overlapped, else None
        self.generation = pool.generation
        self.pool = pool
        self.graphed = None  # the same launches as one graph (runtime/eager_graph.py), built on first eager use
        drv = _drv()
        self._launch, self._ok = drv.cuLaunchKernel, drv.CUresult.CUDA_SUCCESS

    def launch(self, stream: int, ptrs: tuple) -> None:
        """Every launch of the forward on ``stream`` with the call's addresses ``ptrs`` (see PER_CALL)."""
        launch, ok = self._launch, self._ok
        for (fn, gx, gy, gz, bx, by, bz, smem, vals, address, slots, kern, _params), cfg in zip(self.items,
                                                                                             self.overlapped):
            for i, w in slots:
                vals[i] = ptrs[w]
            if cfg is not None:
                driver.launch_ex(cfg, fn, stream, address)
                continue
            err = launch(fn, gx, gy, gz, bx, by, bz, smem, stream, address, 0)[0]
            if err != ok:
                raise DeviceError(f"launching {kern!r} (grid {(gx, gy, gz)}, block {(bx, by, bz)}, smem {smem}) "
                                  f"failed: {err}")
