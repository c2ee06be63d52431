"""The executor's Problem of a call (CPU only: the device queries stubbed): the layer's part is its model config's, so
every plan-time choice sees the layer the kernels are built for. Expert statistics [ext] in particular: a call's
Problem once left ``expert_counts`` out, so calls of 16-64 routes took the lead kernel, which does not count (the GPU
test test_expert_counts_gpu found every count 0 at 4 and 7 rows)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from qmoe_rtc import executor
from qmoe_rtc.kernels.base import Problem
from qmoe_rtc.kernels.route import routes_in_group
from qmoe_rtc.specialize.presets import PRESETS


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr(executor, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(executor, "max_smem_optin", lambda device_id: 232448)


def layer_of(preset: str, **kw):
    """The parts of a QMoE that QMoE.problem reads: its model config (a preset's, per activation dtype), target and
    device."""
    return SimpleNamespace(model_config=lambda dtype: PRESETS[preset].config(dtype=dtype, **kw), _arch=lambda: "sm_90a",
                           device_id=0)


@pytest.mark.parametrize("counts", [False, True])
def test_a_calls_problem_is_its_model_configs(device, counts):
    config = PRESETS["qwen3-30b-a3b"].config(dtype="bfloat16", expert_counts=counts)
    got = executor.QMoE.problem(layer_of("qwen3-30b-a3b", expert_counts=counts), 7, "bfloat16", "bfloat16")
    want = Problem.for_config(config, 7, router_dtype="bfloat16", arch="sm_90a", sms=132, smem=232448)
    assert got == want
    # the config a caller already built (QMoE._choice, engine_for) gives the same Problem
    assert executor.QMoE.problem(layer_of("qwen3-30b-a3b", expert_counts=counts), 7, "bfloat16", "bfloat16",
                                 config=config) == want
    assert got.expert_counts is counts
    # 28 routes: the lead kernel routes such calls unless the layer counts its experts (it has no counting form)
    assert routes_in_group(got) is not counts


def test_the_calls_dtype_is_the_problems(device):
    got = executor.QMoE.problem(layer_of("mixtral-8x7b"), 3, "float16", "float32", "float16")
    assert (got.dtype, got.router_dtype, got.router_weights_dtype, got.rows) == ("float16", "float32", "float16", 3)
