"""The plans a layer gets on a device, walked on the CPU as the executor makes them (QMoE.path_for, choose,
Plan.build's configure / kernel_for / launch / scratch), without compiling or loading anything.

Used by tests/runtime/test_plan_decisions.py (every launch fits the arch's shared memory; sm_90's decisions unchanged) and
to write the fixture those decisions are compared with:

    PYTHONPATH=. python tests/support/plan_walk.py tests/data/plan_decisions_sm90.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

from qmoe_rtc.kernels import Problem, choose, decode_limit, get_family
from qmoe_rtc.kernels.arch import ArchSpec
from qmoe_rtc.specialize import Layout, ModelConfig
from qmoe_rtc.specialize.presets import PRESETS

#: Tokens of a call the decisions are recorded at: 1..64, then 128, 512 and 4096.
TOKENS = (*range(1, 65), 128, 512, 4096)
#: Multiprocessors of the devices planned for (the GPUs each target names: A100, A10 / RTX 3090 class, L4 / L40, H200).
SMS = {"sm_80": 108, "sm_86": 84, "sm_89": 58, "sm_90a": 132}


def ort_2048(dtype: str = "bfloat16") -> ModelConfig:
    """The benchmark's ort-2048 shape (H = I = 2048, 8 experts, top-2, fused SwiGLU, int4 in blocks of 128)."""
    return ModelConfig(hidden=2048, inter=2048, experts=8, k=2,
                       layout=Layout(dtype=dtype, fc1_bits=4, fc2_bits=4, block_size=128, activation="swiglu",
                                     swiglu_fusion=1))


def configs() -> dict[str, ModelConfig]:
    """Every preset's default layout (bf16) with tiled and with contract codes, and the benchmark's ort-2048."""
    out = {}
    for name, p in {**PRESETS, "ort-2048": None}.items():
        cfg = p.config(dtype="bfloat16") if p is not None else ort_2048()
        for tiled in (True, False):
            out[f"{name} tiled={int(tiled)}"] = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, tiled=tiled))
    return out


def problem(cfg: ModelConfig, rows: int, target: str) -> Problem:
    """The problem QMoE.problem builds for ``rows`` tokens on a GPU of ``target`` (its SMs and opt-in shared memory)."""
    return Problem.for_config(cfg, rows, arch=target, sms=SMS[target], smem=ArchSpec(target).smem_limit)


def plan_of(cfg: ModelConfig, rows: int, target: str) -> dict:
    """The executor's plan of a call, as data: its path and pipeline, each family's configure() result, and per step
    the kernel, grid, block, dynamic shared memory, launch scalars, overlap and scratch ({name: [bytes, zeroed]})."""
    p = problem(cfg, rows, target)
    path = "decode" if rows * cfg.k <= decode_limit(cfg, target) else "prefill"
    choice = choose(cfg, p, path)
    specs = {f: get_family(f).spec(cfg) for f in choice.pipeline.families}
    steps = choice.pipeline.steps_for(cfg, p)  # as Plan.build: the steps a call routes inside dropped
    calls = {f: get_family(f).configure(specs[f], p) for f in dict.fromkeys(st.family for st in steps)}
    out = {"path": path, "pipeline": choice.pipeline.name, "configure": {f: repr(c) for f, c in calls.items()},
           "steps": []}
    for st in steps:
        fam, spec, call = get_family(st.family), specs[st.family], calls[st.family]
        ln = fam.launch(spec, st.role, p, call)
        scratch = {name: [slot.nbytes, slot.zero] for name, slot in sorted(fam.scratch(spec, st.role, p, call).items())}
        out["steps"].append([st.family, st.role, fam.kernel_for(spec, st.role, p, call), list(ln.grid), list(ln.block),
                             ln.shared_mem, [list(a) for a in ln.args], ln.overlap, scratch])
    return out


def _sha(value) -> str:
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:10]


def digest(plan: dict) -> str:
    """A plan as its pipeline, a digest of its path, pipeline and steps (every launch and its scratch), then one of its
    configure() results (the fixture's form: the whole plans take ~800 KB). Two digests, so that a change of what a
    family's configure() returns shows apart from a change of what is launched."""
    launched = {key: value for key, value in plan.items() if key != "configure"}
    return f"{plan['pipeline']} {_sha(launched)} {_sha(plan['configure'])}"


def decisions(target: str = "sm_90a") -> dict[str, list[str]]:
    """Per config of :func:`configs`, the :func:`digest` of its plan at each count of :data:`TOKENS`."""
    return {name: [digest(plan_of(cfg, rows, target)) for rows in TOKENS] for name, cfg in configs().items()}


if __name__ == "__main__":
    rows = [f"  {json.dumps(name)}: {json.dumps(plans)}" for name, plans in decisions().items()]
    with open(sys.argv[1], "w") as f:
        f.write(f'{{"target": "sm_90a", "tokens": {json.dumps(TOKENS)}, "plans": {{\n' + ",\n".join(rows) + "\n}}\n")
