"""GPU: expert statistics [ext] (``QMoE(expert_counts=True)``): the routes each expert got, counted inside the routing
kernel, against the reference routing's picks; accumulated over calls and graph replays, zeroed by
``reset_expert_counts`` (also inside a capture), and the layer's output unchanged by counting (skipped without a GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.contract.attributes import QMoEAttributes
from qmoe_rtc.contract.random_layer import random_inputs
from qmoe_rtc.contract.reference import route as reference_route
from qmoe_rtc.errors import QMoEUnsupportedError

from support.ext_layers import build, to_dev
from support.grouped_routing import near_tie_rows

pytestmark = pytest.mark.gpu

CASES = [  # name, E, k, build keywords, extra attributes: the warp, block, sparse-mixer and grouped routing kernels
    ("warp", 64, 4, dict(S=0), {}),
    ("block-gated", 300, 6, dict(S=1, gate=True), dict(normalize_routing_weights=1)),
    ("sparse", 16, 2, dict(S=0), dict(use_sparse_mixer=1)),
    ("grouped", 64, 6, dict(S=1), dict(scoring_func="sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.5)),
]


def layer(rng, E, k, kw, extra, dtype="bfloat16", H=256, I=128, **qmoe_kw):  # noqa: E741
    from qmoe_rtc.executor import QMoE

    w, a, ext = build(rng, E=E, H=H, I=I, k=k, dtype=dtype, bits=4, block_size=64, activation_type="swiglu",
                      swiglu_fusion=1, **kw)
    a = {**a, **extra}
    return QMoE(**to_dev(w), **a, **to_dev(ext), **qmoe_kw), a


def expected_counts(lg, a, E):
    attrs = QMoEAttributes.from_kwargs(**a)
    near = near_tie_rows(lg, None, attrs) if attrs.scoring_func == "sigmoid" else np.zeros(len(lg), bool)
    assert not near.any()  # these data have none: the counts must match exactly
    ids, _ = reference_route(lg, attrs)
    return np.bincount(ids.ravel(), minlength=E)


@pytest.mark.parametrize("name, E, k, kw, extra", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_counts_are_the_reference_routing_and_accumulate(rng, name, E, k, kw, extra, rows):
    import cupy as cp

    moe, a = layer(rng, E, k, kw, extra, expert_counts=True)
    plain, _ = layer(np.random.default_rng(0), E, k, kw, extra)  # not counting (other weights: output not compared)
    assert cp.asnumpy(moe.expert_counts).tolist() == [0] * E
    want = np.zeros(E, np.int64)
    for _ in range(3):
        x, lg, _ = random_inputs(rng, rows, 256, E, "bfloat16")
        moe(cp.asarray(x), cp.asarray(lg))
        want += expected_counts(lg, a, E)
        np.testing.assert_array_equal(cp.asnumpy(moe.expert_counts), want)
    assert want.sum() == 3 * rows * k
    moe.reset_expert_counts()
    assert not cp.asnumpy(moe.expert_counts).any()
    with pytest.raises(QMoEUnsupportedError, match="expert_counts=True"):
        _ = plain.expert_counts


def test_counting_leaves_the_output_bitwise_the_same(rng):
    import cupy as cp

    seed = int(rng.integers(1 << 30))
    moe, _ = layer(np.random.default_rng(seed), 64, 4, dict(S=1), {}, expert_counts=True)
    plain, _ = layer(np.random.default_rng(seed), 64, 4, dict(S=1), {})
    for rows in (1, 16, 300):
        x, lg, _ = random_inputs(rng, rows, 256, 64, "bfloat16")
        y = cp.asnumpy(moe(cp.asarray(x), cp.asarray(lg)))
        np.testing.assert_array_equal(y.view(np.uint16), cp.asnumpy(plain(cp.asarray(x), cp.asarray(lg))).view(np.uint16))


@pytest.mark.parametrize("rows", [4, 256])
def test_graph_replays_count_and_a_captured_reset_zeroes_per_step(rng, rows):
    """A graph recording reset + forward gives per-step counts on every replay; one recording the forward alone
    accumulates."""
    import cupy as cp

    E, k = 64, 4
    moe, a = layer(rng, E, k, dict(S=0), {}, expert_counts=True)
    x, lg, _ = random_inputs(rng, rows, 256, E, "bfloat16")
    xd, ld = cp.asarray(x), cp.asarray(lg)
    out = cp.empty_like(xd)
    moe(xd, ld, out=out)  # plan at this shape before capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        moe.reset_expert_counts(stream)
        moe(xd, ld, out=out)
        graph = stream.end_capture()
    for _ in range(3):
        x, lg, _ = random_inputs(rng, rows, 256, E, "bfloat16")
        # the new inputs written on the replay's stream (a non-blocking one does not wait for the default stream:
        # the replay could read the old ones)
        with stream:
            xd[...], ld[...] = cp.asarray(x), cp.asarray(lg)
            graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(moe.expert_counts), expected_counts(lg, a, E))
    g = moe.capture(xd, ld, out=out)  # the forward alone: replays add up
    moe.reset_expert_counts()
    g.replay()
    g.replay()
    cp.cuda.Device().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(moe.expert_counts), 2 * expected_counts(lg, a, E))


def test_a_slice_counts_the_whole_layers_routing(rng):
    import cupy as cp

    from qmoe_rtc.executor import QMoE

    E, k, H, I = 16, 4, 256, 128  # noqa: E741
    w, a, _ = build(rng, E=E, H=H, I=I, k=k, dtype="bfloat16", bits=4, block_size=64, activation_type="swiglu",
                    swiglu_fusion=1, S=0)
    part = {n: (v[4:12] if n.startswith(("fc1_", "fc2_")) and v is not None else v) for n, v in w.items()}
    moe = QMoE(**to_dev(part), **a, expert_range=(4, 12), num_experts=E, expert_counts=True)
    x, lg, _ = random_inputs(rng, 33, H, E, "bfloat16")
    moe(cp.asarray(x), cp.asarray(lg))
    assert moe.expert_counts.shape == (E,)
    np.testing.assert_array_equal(cp.asnumpy(moe.expert_counts), expected_counts(lg, a, E))
