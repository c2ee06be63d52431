"""Pipelines as data: which family does which step of a forward, in order, and the one place that
chooses a path and an engine.

A pipeline is a tuple of steps ``(family, role)``; the family maps the role to a kernel, its launch
geometry and its scratch (see :class:`~qmoe_rtc.kernels.base.KernelFamily`). A new engine is one
family module plus one entry in :data:`PIPELINES`; the executor interprets whatever is listed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QMoEAttributeError, QMoEUnsupportedError
from ..specialize import ModelConfig, ModuleSpec
from .arch import ArchSpec
from .base import Problem, get_family

__all__ = ["PIPELINES", "Choice", "Pipeline", "Step", "choose", "decode_limit", "engine_table",
           "modules_for"]


@dataclass(frozen=True)
class Step:
    """One launch of a pipeline. ``when``: a :class:`~qmoe_rtc.specialize.ModelConfig` field that must
    be set for the step to run (``"router_gemm"``: the layer computes its own logits); '' = always. ``into``: the role
    of the step that does this step's work at calls where it routes itself ("group": the grouped engines' group launch,
    "fc1": the decode kernels; :func:`~qmoe_rtc.kernels.route.routes_inside`); the step is then not launched."""

    family: str
    role: str
    when: str = ""
    into: str = ""

    def runs(self, config: ModelConfig, problem: Problem | None = None) -> bool:
        if self.into and problem is not None:
            from .route import routes_inside

            if routes_inside(self.into, problem):
                return False
        return not self.when or bool(getattr(config, self.when))


@dataclass(frozen=True)
class Pipeline:
    """A path's engine: its ``steps`` in launch order, what computes its GEMMs (``engine``) and the layers and calls it
    takes (``takes``), the words of the engine table (:func:`engine_table`)."""

    name: str
    path: str  # "decode" | "prefill"
    steps: tuple[Step, ...]
    engine: str = ""
    takes: str = ""

    @property
    def families(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.family for s in self.steps))

    def steps_for(self, config: ModelConfig, problem: Problem | None = None) -> tuple[Step, ...]:
        """The steps that run for ``config`` (conditional ones dropped), at ``problem`` when given (steps done inside
        the group step's launch dropped too: :attr:`Step.into`)."""
        return tuple(s for s in self.steps if s.runs(config, problem))


#: Every pipeline starts with these: the router GEMM when the layer has one, then routing (done inside the group
#: step's launch on the grouped path at calls of few rows, routes_in_group; inside the tensor-core decode kernels at
#: calls of a few rows, routes_in_decode: the ``into`` of :func:`_steps`).
_ROUTING = (Step("route", "logits", when="router_gemm"), Step("route", "route"))


def _steps(*pairs: tuple[str, ...], routed_in: str = "") -> tuple[Step, ...]:
    """A pipeline's steps: routing, then (family, role[, into]) each. ``routed_in``: the role of the step that routes
    the call itself where it can; a grouped pipeline's is its group step."""
    into = "group" if any(p[1] == "group" for p in pairs) else routed_in
    return (_ROUTING[0], Step("route", "route", into=into)) + tuple(Step(*p) for p in pairs)


_TENSOR_CORES = "float16/bfloat16, 1/2/3/4/8-bit and FP8 (FP8 on sm_89+), H and I multiples of 32"

#: Per path, fastest first: the first pipeline whose families all support the layer runs.
PIPELINES: tuple[Pipeline, ...] = (
    Pipeline("decode-mma", "decode", _steps(("mma_decode", "fc1"), ("mma_decode", "fc2"), routed_in="fc1"),
             "tensor cores (mma.sync), FC1 with the activation fused, FC2 with the combine", _TENSOR_CORES),
    Pipeline("decode-gemv", "decode", _steps(("gemv", "fc1"), ("gemv", "fc2")), "SIMT, FC2 with the combine",
             "everything else"),
    Pipeline("prefill-wgmma", "prefill", _steps(("wgmma_prefill", "group"), ("wgmma_prefill", "permute", "", "group"),
                                                ("wgmma_prefill", "fc1"), ("wgmma_prefill", "fc2"),
                                                ("wgmma_prefill", "combine")), "Hopper warpgroup MMA",
             "as decode-mma, on sm_90a: after the decode path on experts of 9 MiB or more, from 4.5 routes per expert "
             "below (`kernels/engine_choice.py`)"),
    Pipeline("prefill-batched", "prefill", _steps(("mma_batched", "group"), ("mma_batched", "fc1"),
                                                  ("mma_batched", "fc2"), ("mma_batched", "combine")),
             "the decode engine's weight stream over grouped routes (batched decode)",
             "as decode-mma, up to 8 routes per expert (16 when the routes reach at most 32 experts; 6 / 12 on untiled "
             "codes or scale blocks below 128); on sm_90a where wgmma is slower"),
    Pipeline("prefill-mma", "prefill", _steps(("mma_prefill", "group"), ("mma_prefill", "fc1"),
                                              ("mma_prefill", "fc2"), ("mma_prefill", "combine")),
             "tensor cores (mma.sync)", "as decode-mma (int8 / FP8 in 32-route tiles where 64 do not fit the GPU's "
             "shared memory: sm_86 / sm_89)"),
    Pipeline("prefill-simt", "prefill", _steps(("gemm", "group"), ("gemm", "fc1"), ("gemm", "fc2"),
                                               ("gemm", "combine")), "SIMT",
             "everything else (float32, `zero_point_offset`, FP8 below sm_89, H or I not multiples of 32)"),
)

#: How the engine table names a step's role.
_ROLE_WORDS = {"route": "route", "group": "group", "permute": "permute", "fc1": "FC1", "fc2": "FC2",
               "combine": "combine"}


def engine_table() -> str:
    """The engine table of README.md ("Which kernels run"), as Markdown, from :data:`PIPELINES`
    (``python -m qmoe_rtc info --engines`` prints it; a CPU test checks that the README holds this text): path,
    pipeline, its launches and engine, what it takes. The router GEMM, a conditional first step, is left out (the
    README says so)."""
    rows = ["| path | pipeline | kernels | takes |", "|---|---|---|---|"]
    for p in PIPELINES:
        launches = " → ".join(_ROLE_WORDS[s.role] for s in p.steps if not s.when)
        rows.append(f"| {p.path} | `{p.name}` | {launches}; {p.engine} | {p.takes} |")
    return "\n".join(rows) + "\n"


def decode_limit(config: ModelConfig, arch: str = "") -> int:
    """Routes (rows·k) up to which the decode path runs for this layer on ``arch`` (the default switch), capped by
    what one decode block scans (512 routes).

    Tensor-core layers on an arch with measured crossovers (:mod:`~qmoe_rtc.kernels.engine_choice`, sm_90): the
    tokens its rule gives (2 for mixtral-8x7b, qwen3-30b-a3b and ort-2048, 6 for gpt-oss-120b).
    Elsewhere (another arch, the arch unknown: warm tool, CPU; or a layer the grouped engines do not run): the arch's
    tuning table's ``decode_rows`` tokens (kernels/tuning/). Layers only the SIMT engines run keep their own switch
    (``simt_decode_rows``, ``simt_decode_rows_big`` on experts of ``simt_big_expert_bytes`` or more).
    """
    from ._expert import tensor_core_unsupported
    from .engine_choice import decode_tokens, expert_code_bytes

    t = ArchSpec(arch).tuning
    if tensor_core_unsupported(config) is None:
        tokens = decode_tokens(config, arch, get_family("wgmma_prefill").supports(config, None) is None)
        return int(min(512, (t.decode_rows if tokens is None else tokens) * config.k))
    expert_bytes = expert_code_bytes(config.hidden, config.inter, config.layout)
    rows = t.simt_decode_rows_big if expert_bytes >= t.simt_big_expert_bytes else t.simt_decode_rows
    return int(min(512, rows * config.k))


@dataclass(frozen=True)
class Choice:
    pipeline: Pipeline
    skipped: tuple[tuple[str, str], ...]  # (faster pipeline, why it cannot run), in preference order
    passed: tuple[tuple[str, str], ...] = ()  # (pipeline, why it is slower at this problem): no warning


def _why_not(pipeline: Pipeline, config: ModelConfig, problem: Problem | None, test: str = "supports") -> str | None:
    for fam in pipeline.families:
        why = getattr(get_family(fam), test)(config, problem)
        if why:
            return f"{fam}: {why}"
    return None


def choose(config: ModelConfig, problem: Problem | None, path: str) -> Choice:
    """The fastest pipeline of ``path`` that runs ``config`` (at ``problem``), and why the faster ones don't. A
    pipeline passed over as slower still runs the layer where none after it can (a device limit may refuse those:
    its shared memory per block, kernels/base.py Problem.smem_limit)."""
    skipped, passed, runnable = [], [], []
    for p in PIPELINES:
        if p.path != path:
            continue
        why = _why_not(p, config, problem)
        if why is not None:
            skipped.append((p.name, why))
            continue
        slower = _why_not(p, config, problem, "slower")
        if slower is not None:
            passed.append((p.name, slower))
            runnable.append(p)
            continue
        return Choice(p, tuple(skipped), tuple(passed))
    if runnable:  # the faster ones it was passed over for could not run: skipped before it, as ever
        first = runnable[0]
        order = [p.name for p in PIPELINES]
        faster = tuple((n, w) for n, w in skipped if order.index(n) < order.index(first.name))
        return Choice(first, faster, tuple(passed[1:]))
    raise QMoEUnsupportedError(f"no {path} pipeline runs this layer: " + "; ".join(f"{n}: {w}" for n, w in skipped))


def modules_for(config: ModelConfig, variants=("decode", "prefill"), arch: str = "") -> list[ModuleSpec]:
    """Every module the executor can load for ``config`` on ``variants`` (what the warm tool compiles):
    per path, the specs of each family of every pipeline that runs the layer, up to the first one
    whose use does not depend on the call (a family with ``conditional`` set runs only at some sizes
    or on some devices; ``arch``, when given, settles the device part)."""
    seen: dict[ModuleSpec, None] = {}
    probe = Problem.for_config(config, 0, arch=arch) if arch else None
    for path in variants:
        if path not in ("decode", "prefill"):
            raise QMoEAttributeError("variants", "items of ['decode', 'prefill']", repr(path))
        for p in PIPELINES:
            if p.path != path or _why_not(p, config, probe) is not None:
                continue
            for fam in p.families:
                for spec in get_family(fam).specs(config):
                    seen.setdefault(spec, None)
            if not any(get_family(f).conditional for f in p.families):
                break
    return list(seen)
