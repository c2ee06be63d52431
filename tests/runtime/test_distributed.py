"""qmoe_rtc.distributed on the CPU: which experts a rank holds (even split, placements and their
refusals) and the wrapper's refusals before any GPU or process-group work."""

from __future__ import annotations

import importlib.util

import pytest

from qmoe_rtc import errors
from qmoe_rtc.contract.random_layer import random_layer
from qmoe_rtc.distributed import ExpertParallelQMoE, rank_experts


def test_even_split_and_placement():
    assert [rank_experts(8, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    place = [1, 0, 1, 0, 0, 1, 1, 0]
    assert rank_experts(8, 2, 0, place) == [1, 3, 4, 7] and rank_experts(8, 2, 1, place) == [0, 2, 5, 6]


@pytest.mark.parametrize("place, why", [([0, 1, 0], "one rank per expert"), ([0, 2, 0, 1], "ranks in 0..1"),
                                        ([0, 0, 0, 0], "at least one expert on every rank")])
def test_placement_refusals(place, why):
    with pytest.raises(errors.QMoEInputError, match=why) as ei:
        rank_experts(4, 2, 1, place)
    assert ei.value.name == "placement"


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_wrapper_without_torch_says_so(rng):
    w, a = random_layer(rng, E=4, H=64, I=32, k=2, dtype="float16")
    with pytest.raises(errors.DeviceError, match="torch"):
        ExpertParallelQMoE(**w, **a)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_wrapper_needs_an_initialized_group(rng):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized")
    w, a = random_layer(rng, E=4, H=64, I=32, k=2, dtype="float16")
    with pytest.raises(errors.QMoEAttributeError) as ei:
        ExpertParallelQMoE(**w, **a)
    assert ei.value.name == "group"

