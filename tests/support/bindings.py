"""The by-name binding check of the pipelines (tests/kernels/test_pipelines.py), for any layer config: the FP8
suites run it on theirs."""

from __future__ import annotations

from qmoe_rtc.contract import QMoEAttributes
from qmoe_rtc.jit import Launch, Ptr
from qmoe_rtc.jit.args import leaves
from qmoe_rtc.kernels import PIPELINES, Problem, get_family
from qmoe_rtc.runtime.plan import PER_CALL, problem_scalars
from qmoe_rtc.runtime.tensors import layer_table

LAYER_SCALARS = set(problem_scalars(Problem(rows=1, E=8, H=64, I=32, k=2, dtype="float16")))


def _table():
    proj = {p: (object(), object(), None, None) for p in ("fc1", "fc2")}
    return layer_table(proj, QMoEAttributes.from_kwargs(k=2))


def check_every_argument_bound(cfg, rows: int) -> None:
    """Every argument of every kernel each pipeline that runs ``cfg`` at ``rows`` launches is bound by name: from
    the executor's table, the scratch the pipeline declares, its launch scalars or the per-call arrays."""
    table = set(_table())
    problem = Problem(rows=rows, E=cfg.experts, H=cfg.hidden, I=cfg.inter, k=cfg.k, dtype=cfg.layout.dtype,
                      shared=cfg.shared, shared_gate=cfg.shared_gate, router_gemm=cfg.router_gemm,
                      all_experts=cfg.all_experts)
    ran = 0
    for pipeline in PIPELINES:
        if any(get_family(f).supports(cfg, problem) for f in pipeline.families):
            continue
        ran += 1
        scratch = set()
        steps = []
        for st in pipeline.steps_for(cfg):
            fam = get_family(st.family)
            spec = fam.spec(cfg)
            kdefs = {k.key: k for k in fam.kernels(spec)}
            key = fam.kernel_for(spec, st.role, problem)
            assert key in kdefs, (pipeline.name, st, key, sorted(kdefs))
            launch = fam.launch(spec, st.role, problem)
            assert isinstance(launch, Launch) and min(launch.grid) >= 1 and min(launch.block) >= 1
            scratch |= set(fam.scratch(spec, st.role, problem))
            steps.append((kdefs[key], launch))
        for kdef, launch in steps:
            bound = table | LAYER_SCALARS | scratch | {n for n, _ in launch.args} | set(PER_CALL)
            missing = [a.name for a in leaves(kdef.args) if a.name not in bound]
            assert not missing, (pipeline.name, kdef.key, missing)
            for a in leaves(kdef.args):  # a scratch pointer a kernel reads was declared by some step of the pipeline
                if isinstance(a, Ptr) and a.name not in table and a.name not in PER_CALL:
                    assert a.name in scratch, (pipeline.name, kdef.key, a.name)
    assert ran >= 2  # each config has at least one decode and one prefill pipeline
