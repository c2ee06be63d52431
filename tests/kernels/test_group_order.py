"""The grouping's order (CPU only): a NumPy model of ``group_by_expert`` (routing/group.cuh) -- warps owning
contiguous routes, experts a slice at a time, per-warp count rows, a scan over the warps, lanes of one
expert grouped and ranked as the kernel's ``lanes_alike`` (ballots per key bit) and the lane mask give
them -- places the routes exactly as a stable sort by expert (``np.argsort(ids, kind="stable")``, ids of -1
left out), for every E up to the grouping's limit; the kernel compiles for sm_80, sm_86 and sm_90. The same
check on a GPU: ``tests/kernels/test_group_order_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest

from qmoe_rtc.jit import CompileUnit, get_cubin
from qmoe_rtc.jit.compiler import cuda_src_dir
from qmoe_rtc.kernels._grouped import GROUP_KERNEL, GROUP_MAX_EXPERTS, GROUP_THREADS

SLICE = 256  # kGroupSlice
UNIT = CompileUnit("group_order_test", '#include "routing/group.cuh"\n', (GROUP_KERNEL,))


def expected(ids: np.ndarray, E: int, BR: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets [E + 1], tile_offsets [E + 1], sorted [kept]): the stable sort by expert, -1 ids left out."""
    counts = np.bincount(ids[ids >= 0], minlength=E)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    tiles = np.concatenate([[0], np.cumsum((counts + BR - 1) // BR)])
    order = np.argsort(np.where(ids < 0, E, ids), kind="stable")[: offsets[-1]]
    return offsets, tiles, order


def model_group(ids: np.ndarray, E: int, BR: int, threads: int = GROUP_THREADS, slice_: int = SLICE):
    """What the kernel computes, step by step: (offsets, tile_offsets, sorted [R], -1 where never written)."""
    R, warps = len(ids), threads // 32
    L = -(-R // threads) * 32  # routes a warp, whole steps of 32
    offsets, tile_offsets = np.zeros(E + 1, np.int64), np.zeros(E + 1, np.int64)
    out = np.full(R, -1, np.int64)
    lanes = np.arange(32)
    before = lanes[None, :] < lanes[:, None]  # [lane, other]: other is a lower lane
    carry_c = carry_t = 0

    def walk(table, e0, e1, place):
        for w in range(warps):
            r0 = min(w * L, R)
            r1 = min(r0 + L, R)
            for s in range(r0, r1, 32):
                r = s + lanes
                idv = np.where(r < r1, ids[np.minimum(r, R - 1)], -1)
                key = np.where((idv >= e0) & (idv < e1), idv, -1)
                same = key[:, None] == key[None, :]  # the lanes' peers
                rank, n = (same & before).sum(1), same.sum(1)
                base = table[w, np.maximum(key - e0, 0)].copy()  # what each group's leader reads
                if place:
                    hit = key >= 0
                    out[base[hit] + rank[hit]] = r[hit]
                leaders = (key >= 0) & (rank == 0)
                table[w, key[leaders] - e0] = base[leaders] + n[leaders]

    for e0 in range(0, E, slice_):
        e1 = min(e0 + slice_, E)
        table = np.zeros((warps, slice_), np.int64)
        walk(table, e0, e1, False)
        c = table.sum(0)[: e1 - e0]
        t = (c + BR - 1) // BR
        first_c = carry_c + np.cumsum(c) - c
        first_t = carry_t + np.cumsum(t) - t
        offsets[e0:e1], tile_offsets[e0:e1] = first_c, first_t
        table[:, : e1 - e0] = first_c[None, :] + np.cumsum(table[:, : e1 - e0], 0) - table[:, : e1 - e0]
        carry_c += int(c.sum())
        carry_t += int(t.sum())
        walk(table, e0, e1, True)
    offsets[E], tile_offsets[E] = carry_c, carry_t
    return offsets, tile_offsets, out


def draw_ids(rng, R: int, E: int, skew: bool, dropped: float) -> np.ndarray:
    """Expert ids of R routes: uniform or skewed (a few experts take most routes), a share set to -1."""
    p = None
    if skew:
        p = rng.exponential(size=E) ** 4
        p /= p.sum()
    ids = rng.choice(E, size=R, p=p).astype(np.int32)
    ids[rng.random(R) < dropped] = -1
    return ids


@pytest.mark.parametrize("E, R", [(1, 5), (8, 2000), (16, 2000), (16, 31), (128, 4097), (255, 3000), (256, 1024),
                                  (257, 1500), (512, 8192), (GROUP_MAX_EXPERTS, 5000), (64, 0), (8, 33)])
def test_model_is_a_stable_sort_by_expert(rng, E, R):
    for skew, dropped, BR in ((False, 0.0, 64), (True, 0.0, 32), (False, 0.2, 128)):
        ids = draw_ids(rng, R, E, skew, dropped) if R else np.zeros(0, np.int32)
        off, tiles, out = model_group(ids, E, BR)
        want_off, want_tiles, want = expected(ids, E, BR)
        np.testing.assert_array_equal(off, want_off)
        np.testing.assert_array_equal(tiles, want_tiles)
        np.testing.assert_array_equal(out[: want_off[-1]], want)
        assert np.all(out[want_off[-1]:] == -1)  # past the kept routes: never written


def test_model_small_block_many_steps(rng):
    """Several steps a warp and several slices with a small model block (the same rules at other sizes)."""
    ids = draw_ids(rng, 3000, 40, True, 0.1)
    off, tiles, out = model_group(ids, 40, 16, threads=64, slice_=16)
    want_off, want_tiles, want = expected(ids, 40, 16)
    np.testing.assert_array_equal(off, want_off)
    np.testing.assert_array_equal(tiles, want_tiles)
    np.testing.assert_array_equal(out[: want_off[-1]], want)


def test_header_constants_match_the_family():
    text = (cuda_src_dir() / "routing" / "group.cuh").read_text()
    assert f"kGroupThreads = {GROUP_THREADS};" in text
    assert f"kGroupSlice = {SLICE};" in text
    assert "atomicAdd" not in text  # no position may depend on arrival order


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_group_kernel_compiles(cache, arch):
    mod = get_cubin(UNIT, arch)
    assert mod.cubin[:4] == b"\x7fELF"
    assert mod.lowered["group"].startswith("_ZN4qmoe15group_by_expert")
