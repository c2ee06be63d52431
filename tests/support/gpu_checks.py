"""What the GPU suites share: the tolerances against the float64 reference (:data:`TOL`), :func:`rel_err`,
:func:`to_dev` (a layer's arrays onto the GPU), the graph-replay checks, an expert slice's part of a layer and the 3-bit
tensor-core layers."""

from __future__ import annotations

import math

import numpy as np

from qmoe_rtc.contract.random_layer import random_inputs, random_layer
from qmoe_rtc.contract.reference import qmoe as reference

TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}

#: 3-bit layers of the tensor-core suites (decode and prefill), as (name, random_layer kwargs, E, H, I):
#: one 96-bit string per lane, pairs cut by funnel shifts; a scale per chunk, blocks of 16 with float32
#: scales + FC3 + K % 128 != 0, row-wise, 3-bit FC2 under 4-bit FC1 / FC3 with zero points, and packed
#: 3-bit zero points (two staged words: a zero point may straddle them) with blocks of 16, 64 and row-wise
TENSOR_CORE_3BIT = [
    ("b3-bs128-swiglu1", dict(bits=3, block_size=128, activation_type="swiglu", swiglu_fusion=1, k=4), 16, 256, 128),
    ("b3-bs16-f32-scales-silu-fc3", dict(bits=3, block_size=16, activation_type="silu", fc3=True, k=2,
                                         scale_dtype="float32", bias=True), 8, 160, 96),
    ("b3-rowwise-gelu", dict(bits=3, block_size=0, activation_type="gelu", k=2), 8, 128, 64),
    ("mixed-4-3-4-fc3-zp", dict(bits=(4, 3, 4), block_size=32, zero_points=(True, False, True),
                                activation_type="silu", fc3=True, k=2), 8, 128, 64),
    ("b3-bs16-zp-swiglu1", dict(bits=3, block_size=16, zero_points=True, activation_type="swiglu", swiglu_fusion=1,
                                k=2), 8, 256, 128),
    ("b3-bs64-zp-silu-fc3", dict(bits=3, block_size=64, zero_points=True, activation_type="silu", fc3=True, k=4),
     16, 192, 128),
    ("b3-rowwise-zp-gelu-bias", dict(bits=3, block_size=0, zero_points=True, activation_type="gelu", k=2, bias=True),
     8, 128, 96),
    ("mixed-3-3-3-zp-fc3-only", dict(bits=3, block_size=32, zero_points=(False, True, True), activation_type="silu",
                                     fc3=True, k=2), 8, 128, 64),
]


def rel_err(got, want):
    g = np.asarray(got).astype(np.float64)
    w = np.asarray(want).astype(np.float64)
    if not np.isfinite(g).all():
        return math.inf
    n = np.linalg.norm(w)
    return np.linalg.norm(g - w) / (n if n else 1.0)


def to_dev(d):
    import cupy as cp

    return {n: (None if v is None else cp.asarray(v)) for n, v in d.items()}


def eager_and_replay(moe, x, lg, want, label: str, dtype: str = "bfloat16", rw=None):
    """The layer's eager output for ``x`` (into a NaN-poisoned buffer: every element written) against the reference
    ``want`` within ``dtype``'s tolerance, then a graph replay of the same inputs (output poisoned again) equal to it
    bitwise; returns the output (host)."""
    import cupy as cp

    xd, ld = cp.asarray(x), cp.asarray(lg)
    rd = None if rw is None else cp.asarray(rw)
    out = cp.full(x.shape, cp.nan, dtype=xd.dtype)
    moe(xd, ld, rd, out=out)
    got = cp.asnumpy(out)
    assert rel_err(got, want) <= TOL[dtype], label
    g = moe.capture(xd, ld, rd)
    g.output.fill(cp.nan)
    g.replay()
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(g.output), got, err_msg=label)
    return got


#: The per-expert inputs of a layer (by ONNX Runtime input name), which an expert slice [ext] holds only its part of.
PER_EXPERT = {f"{p}_{t}" for p in ("fc1", "fc2", "fc3")
              for t in ("experts_weights", "scales", "zero_points", "experts_bias", "global_scale")}


def expert_slice(w: dict, e0: int, e1: int) -> dict:
    """The inputs of the slice of experts ``e0 .. e1 - 1`` of layer ``w``: the per-expert ones cut, the rest as they are."""
    return {n: (v[e0:e1] if n in PER_EXPERT and v is not None else v) for n, v in w.items()}


def slice_case(rng, rows: int, E: int = 16, H: int = 256, I: int = 128, k: int = 4, held=(4, 12)):  # noqa: E741
    """An expert slice [ext] to run: a bf16 int4 layer of ``E`` experts (blocks of 64, swiglu) of which the slice holds
    experts ``held[0] .. held[1] - 1``, and a call of ``rows`` rows: ``(the slice's inputs, attributes, x, logits, the
    slice's float64 part, the slice's QMoE arguments)``."""
    w, a = random_layer(rng, E=E, H=H, I=I, dtype="bfloat16", bits=4, block_size=64, k=k, activation_type="swiglu",
                        swiglu_fusion=1)
    part = expert_slice(w, *held)
    x, lg, _ = random_inputs(rng, rows, H, E, "bfloat16")
    args = dict(expert_range=tuple(held), num_experts=E)
    return part, a, x, lg, reference(x, lg, **part, **a, **args), args


def check_graph_replay_equals_eager(rng, moe, rows, H, E, w, a, replays: int = 3) -> None:
    """A float16 layer captured once, then replayed on fresh inputs into a poisoned output: each replay
    bitwise equal to an eager call on the same inputs and within tolerance of the float64 reference."""
    import cupy as cp

    x0, l0, _ = random_inputs(rng, rows, H, E, "float16")
    g = moe.capture(cp.asarray(x0), cp.asarray(l0))
    for _ in range(replays):
        x, lg, _ = random_inputs(rng, rows, H, E, "float16")
        g.output.fill(cp.nan)
        g.update(cp.asarray(x), cp.asarray(lg))
        y_graph = cp.asnumpy(g.replay()).copy()
        y_eager = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg)))
        np.testing.assert_array_equal(y_graph, y_eager)
        assert rel_err(y_graph, reference(x, lg, **w, **a)) <= TOL["float16"]
