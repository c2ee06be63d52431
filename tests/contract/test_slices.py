"""Expert slices [ext] on the CPU: argument validation (one test per refusal), the even split, and the
reference's partial outputs summing to the whole layer."""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc import errors
from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe
from qmoe_rtc.contract.slices import describe_slice, even_split

E, H, I = 8, 64, 32  # noqa: E741

EXPERT_AXIS = ("fc1_experts_weights", "fc1_scales", "fc1_zero_points", "fc1_experts_bias", "fc2_experts_weights",
               "fc2_scales", "fc2_zero_points", "fc2_experts_bias", "fc3_experts_weights", "fc3_scales",
               "fc3_zero_points", "fc3_experts_bias")


def take(w: dict, experts) -> dict:
    """The weights of ``experts`` (global ids, in local order)."""
    idx = np.asarray(experts)
    return {n: (v[idx] if n in EXPERT_AXIS and v is not None else v) for n, v in w.items()}


def test_no_slice_arguments_mean_no_slice():
    assert describe_slice() is None


def test_range_slice():
    sl = describe_slice(expert_range=(2, 5), num_experts=8, local_experts=3)
    assert sl.held == (2, 3, 4) and sl.is_range and sl.local_experts == 3
    assert sl.global_to_local().tolist() == [-1, -1, 0, 1, 2, -1, -1, -1]


def test_map_slice():
    sl = describe_slice(expert_map=np.array([-1, 1, -1, 0, -1]), local_experts=2)
    assert sl.held == (3, 1) and not sl.is_range and sl.num_experts == 5
    assert sl.global_to_local().tolist() == [-1, 1, -1, 0, -1]


@pytest.mark.parametrize("kw, cls, name", [
    (dict(expert_range=(2, 5)), errors.QMoEAttributeError, "num_experts"),
    (dict(expert_range=(5, 5), num_experts=8), errors.QMoEAttributeError, "expert_range"),
    (dict(expert_range=(0, 9), num_experts=8), errors.QMoEAttributeError, "expert_range"),
    (dict(expert_range=(-1, 3), num_experts=8), errors.QMoEAttributeError, "expert_range"),
    (dict(expert_range=(0, 2, 3), num_experts=8), errors.QMoEAttributeError, "expert_range"),
    (dict(expert_range=(0.0, 2), num_experts=8), errors.QMoEAttributeError, "expert_range"),
    (dict(expert_range=(0, 2), num_experts=True), errors.QMoEAttributeError, "num_experts"),
    (dict(num_experts=8), errors.QMoEAttributeError, "num_experts"),
    (dict(expert_range=(0, 2), num_experts=8, expert_map=np.array([0, 1])), errors.QMoEAttributeError, "expert_map"),
    (dict(expert_map=np.array([0, 1]), num_experts=2), errors.QMoEAttributeError, "num_experts"),
    (dict(expert_map=np.array([[0, 1]])), errors.QMoEInputError, "expert_map"),
    (dict(expert_map=np.array([0.0, 1.0])), errors.QMoEInputError, "expert_map"),
    (dict(expert_map=np.array([-1, -1])), errors.QMoEInputError, "expert_map"),
    (dict(expert_map=np.array([0, -2])), errors.QMoEInputError, "expert_map"),
    (dict(expert_map=np.array([0, 0])), errors.QMoEInputError, "expert_map"),
    (dict(expert_map=np.array([0, 2])), errors.QMoEInputError, "expert_map"),
    (dict(expert_range=(0, 3), num_experts=8, local_experts=4), errors.QMoEInputError, "fc1_experts_weights"),
])
def test_slice_refusals_name_the_argument(kw, cls, name):
    with pytest.raises(cls) as ei:
        describe_slice(**kw)
    assert type(ei.value) is cls and ei.value.name == name, str(ei.value)


@pytest.mark.parametrize("E_, R", [(8, 1), (8, 2), (8, 3), (256, 8), (5, 5)])
def test_even_split_covers_every_expert_once(E_, R):
    ranges = [even_split(E_, R, r) for r in range(R)]
    assert ranges[0][0] == 0 and ranges[-1][1] == E_
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e1 - e0 for e0, e1 in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@pytest.mark.parametrize("bad", [dict(num_experts=3, ranks=4, rank=0), dict(num_experts=8, ranks=2, rank=2),
                                 dict(num_experts=8, ranks=0, rank=0)])
def test_even_split_refuses(bad):
    with pytest.raises(errors.QMoEAttributeError):
        even_split(**bad)


@pytest.mark.parametrize("R", [2, 3])
def test_reference_slices_sum_to_the_whole_layer(rng, R):
    w, a = random_layer(rng, E=E, H=H, I=I, k=3, dtype="float32", bits=4, block_size=16, bias=True)
    x, lg, _ = random_inputs(rng, 7, H, E, "float32")
    whole = qmoe(x, lg, **w, **a).astype(np.float64)
    parts = []
    for r in range(R):
        e0, e1 = even_split(E, R, r)
        parts.append(qmoe(x, lg, **take(w, range(e0, e1)), **a, expert_range=(e0, e1), num_experts=E))
    assert np.allclose(sum(p.astype(np.float64) for p in parts), whole, rtol=1e-5, atol=1e-6)
    assert all(np.abs(p).max() > 0 for p in parts)  # each slice really contributes


def test_reference_map_slices_with_router_weights_sum_to_the_whole_layer(rng):
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float32", bits=8, activation_type="silu", fc3=True)
    x, lg, rw = random_inputs(rng, 5, H, E, "float32", router_weights=True)
    whole = qmoe(x, lg, router_weights=rw, **w, **a).astype(np.float64)
    held = [[6, 1, 3, 0], [2, 7, 5, 4]]  # any placement, in any local order
    total = 0.0
    for experts in held:
        m = np.full(E, -1)
        m[experts] = np.arange(len(experts))
        total = total + qmoe(x, lg, router_weights=rw, **take(w, experts), **a, expert_map=m).astype(np.float64)
    assert np.allclose(total, whole, rtol=1e-5, atol=1e-6)


def test_reference_slice_refuses_logits_of_the_slice_width(rng):
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float32")
    x, lg, _ = random_inputs(rng, 3, H, E, "float32")
    with pytest.raises(errors.QMoEInputError) as ei:
        qmoe(x, lg[:, :4], **take(w, range(4)), **a, expert_range=(0, 4), num_experts=E)
    assert ei.value.name == "router_probs"


# ---- the GPU layer: slices validated before the driver -------------------------------------------------

import qmoe_rtc  # noqa: E402


@pytest.mark.parametrize("bad, name", [
    (dict(expert_range=(0, 3), num_experts=E), "fc1_experts_weights"),  # 4 experts' weights, a slice of 3
    (dict(expert_range=(0, 4)), "num_experts"),
    (dict(expert_map=np.array([0, 1, 2, 2, -1, -1, -1, -1])), "expert_map"),
])
def test_gpu_slice_refusals_come_before_the_driver(machine, rng, bad, name):
    calls = machine(lib=False)
    w, a = random_layer(rng, E=E, H=H, I=I, k=2, dtype="float16")
    with pytest.raises((errors.QMoEInputError, errors.QMoEAttributeError)) as ei:
        qmoe_rtc.QMoE(**take(w, range(4)), **a, **bad)
    assert ei.value.name == name and calls == []


def test_gpu_slice_with_k_above_its_experts_reaches_the_driver(machine, rng):
    machine(lib=False)
    w, a = random_layer(rng, E=E, H=H, I=I, k=6, dtype="float16")
    with pytest.raises(errors.DeviceError):  # valid: k = 6 of the layer's 8 experts, 2 held here
        qmoe_rtc.QMoE(**take(w, [3, 5]), **a, expert_map=np.array([-1, -1, -1, 0, -1, 1, -1, -1]))
