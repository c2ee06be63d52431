"""Expert statistics [ext] in the route family (CPU and NVRTC, no GPU): a layer that counts gets modules whose
kernels count (COUNT = true), every other layer the same kernels as before with COUNT = false, the counts buffer
binds by name from the layer's table, and every counting variant compiles. On the GPU:
tests/runtime/test_expert_counts_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.jit import get_cubin
from qmoe_rtc.kernels import get_family, spec_unit
from qmoe_rtc.runtime.tensors import layer_table
from qmoe_rtc.specialize import Layout, ModelConfig, ModuleSpec

FAM = get_family("route")


def cfg(E=64, sparse=False, gate=False, sigmoid=False, counts=True):
    lay = Layout(dtype="bfloat16", fc1_bits=4, fc2_bits=4, block_size=0, activation="swiglu", swiglu_fusion=1)
    return ModelConfig(hidden=256, inter=128, experts=E, k=2, layout=lay, use_sparse_mixer=sparse, shared=int(gate),
                       shared_gate=gate, scoring_func="sigmoid" if sigmoid else "softmax", n_group=4 if sigmoid else 0,
                       expert_counts=counts)


@pytest.mark.parametrize("c", [cfg(), cfg(E=300), cfg(sparse=True), cfg(gate=True), cfg(sigmoid=True)],
                         ids=["warp", "block", "sparse", "gate", "grouped"])
def test_a_counting_layer_gets_counting_kernels_and_no_other_change(c):
    spec, plain = FAM.spec(c), FAM.spec(dataclasses.replace(c, expert_counts=False))
    assert spec.get("counts") == 1 and plain.get("counts") is None and spec.name != plain.name
    kds, kds0 = FAM.kernels(spec), FAM.kernels(plain)
    assert [k.key for k in kds] == [k.key for k in kds0] and [k.args for k in kds] == [k.args for k in kds0]
    for k, k0 in zip(kds, kds0):
        assert k.name_expr.endswith(", true>") and k0.name_expr.endswith(", false>")
        assert k.name_expr[: -len(", true>")] == k0.name_expr[: -len(", false>")]
        assert k.arg_names()[-1] == "expert_counts" and k.args[-1].nullable and k.args[-1].dtype == "int64"


def test_the_counts_buffer_binds_from_the_layer_table():
    attrs = QMoEAttributes.from_kwargs(k=2)
    proj = {p: (object(), object(), None, None) for p in ("fc1", "fc2")}
    assert layer_table(proj, attrs)["expert_counts"] is None  # not counting: the kernels never read it
    buf = object()
    assert layer_table(proj, attrs, extras={"expert_counts": buf})["expert_counts"] is buf


@pytest.mark.parametrize("params", [dict(counts=1), dict(counts=1, warp=1), dict(counts=1, sigmoid=1, gate=1),
                                    dict(counts=1, rgemm=1)], ids=lambda p: "-".join(p))
def test_counting_variants_compile(cache, params):
    spec = ModuleSpec.make("route", dtype="bfloat16", **params)
    mod = get_cubin(spec_unit(spec), "sm_90")
    assert mod.cubin[:4] == b"\x7fELF" and set(mod.lowered) == {k.key for k in FAM.kernels(spec)}
