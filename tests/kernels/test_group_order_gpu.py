"""GPU: ``group_by_expert`` (routing/group.cuh) launched directly places the routes as a stable sort by expert
(skipped without a GPU).

Random expert ids (uniform, skewed, some -1), E from 8 to the grouping's limit, up to 32768 routes: ``sorted``
must equal ``np.argsort(ids, kind="stable")`` exactly (ids of -1 left out, positions past the kept routes left
as they were), the offsets and tile offsets their counts' scans, and a second launch (on poisoned outputs)
must give the same bytes. The NumPy model of the kernel's steps: ``tests/kernels/test_group_order.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_group_order import UNIT, draw_ids, expected

from qmoe_rtc.kernels._grouped import GROUP_MAX_EXPERTS, group_launch

pytestmark = pytest.mark.gpu

POISON = -7


def launch(ids: np.ndarray, E: int, BR: int):
    """One grouping on fresh, poisoned outputs: (offsets, tile_offsets, sorted) on the host."""
    import cupy as cp

    from qmoe_rtc.jit import load_module

    kern = load_module(UNIT)["group"]
    R = len(ids)
    d_ids = cp.asarray(ids)
    offsets = cp.full(E + 1, POISON, cp.int32)
    tiles = cp.full(E + 1, POISON, cp.int32)
    out = cp.full(max(R, 1), POISON, cp.int32)
    lc = group_launch(BR)
    kern(lc.grid, lc.block, [d_ids, R, E, BR, offsets, tiles, out], shared_mem=lc.shared_mem)
    cp.cuda.get_current_stream().synchronize()
    return offsets.get(), tiles.get(), out.get()[:R]


@pytest.mark.parametrize("E", [8, 16, 128, 512, GROUP_MAX_EXPERTS])
@pytest.mark.parametrize("R", [1, 31, 200, 2000, 4097, 32768])
def test_sorted_is_the_stable_sort_by_expert(rng, E, R):
    for skew, dropped, BR in ((False, 0.0, 64), (True, 0.0, 32), (False, 0.1, 128)):
        ids = draw_ids(rng, R, E, skew, dropped)
        off, tiles, out = launch(ids, E, BR)
        want_off, want_tiles, want = expected(ids, E, BR)
        np.testing.assert_array_equal(off, want_off)
        np.testing.assert_array_equal(tiles, want_tiles)
        np.testing.assert_array_equal(out[: want_off[-1]], want, err_msg=f"E {E} R {R} skew {skew} dropped {dropped}")
        assert np.all(out[want_off[-1]:] == POISON)  # past the kept routes: never written
        for a, b in zip(launch(ids, E, BR), (off, tiles, out)):  # a second launch: the same bytes
            np.testing.assert_array_equal(a, b)


def test_every_route_one_expert(rng):
    """The worst case for lane groups: all 32768 routes on one expert (every step one group of 32)."""
    ids = np.full(32768, 5, np.int32)
    off, tiles, out = launch(ids, 16, 64)
    np.testing.assert_array_equal(out, np.arange(32768))
    assert off[5] == 0 and off[6] == 32768 and tiles[16] == 512


@pytest.mark.parametrize("engine", ["mma", "wgmma"])
def test_a_forward_groups_in_stable_order(rng, engine):
    """Inside a planned forward of issue 23's layer (1000 rows), the grouping's ``sorted`` is the stable sort of
    the routing's ids, the same on a second forward."""
    import cupy as cp
    from test_route_order_gpu import _run_steps

    from qmoe_rtc.cli import stress
    from qmoe_rtc.contract.random_layer import random_inputs, random_layer
    from qmoe_rtc.executor import QMoE
    from qmoe_rtc.settings import knobs

    from support.gpu_checks import to_dev

    if engine == "wgmma" and cp.cuda.Device().compute_capability != "90":
        pytest.skip("the wgmma engine needs sm_90a")
    name, kw, E, H, I, dtype = {lay[0]: lay for lay in stress.LAYOUTS}[stress.RACE_LAYOUT]
    kw = dict(kw)
    w, a = random_layer(rng, E=E, H=H, I=I, k=kw.pop("k"), dtype=dtype, **kw)
    seen = []

    def check(bufs, problem):
        ids = cp.asnumpy(bufs["topk_ids"].view(cp.int32)[: problem.routes])
        got = cp.asnumpy(bufs["sorted"].view(cp.int32)[: problem.routes])
        np.testing.assert_array_equal(got, np.argsort(ids, kind="stable"))
        seen.append(got)

    with knobs.scope(prefill_engine=engine):
        moe = QMoE(**to_dev(w), **a, decode_max_routes=0)
        x0, l0, _ = random_inputs(rng, 1000, H, E, dtype)
        x, lg = cp.asarray(x0), cp.asarray(l0)
        moe(x, lg)  # plans the call and sizes this stream's scratch pool, which the steps below run in
        for _ in range(2):
            _run_steps(cp, moe, x, lg, cp.empty_like(x), check)
        assert moe.engine_for(1000, dtype).pipeline.name == f"prefill-{engine}"
    assert len(seen) == 2 and np.array_equal(seen[0], seen[1])
