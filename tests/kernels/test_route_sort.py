"""The routing sort (CPU only): a NumPy model of ``routing/bitonic.cuh`` -- the same compare-exchange
rules per element (the lower / upper element of a pair, the run's direction, in-thread pairs for
strides of a block's width and more, only the P elements of the network) -- orders the routing
composites exactly as a plain descending sort, for every E up to the routing limit, with ties."""

from __future__ import annotations

import numpy as np
import pytest

THREADS, J = 128, 4  # kRouteThreads, kRoutePerThread


def keep(mine, other, e, stride, size):
    lower, desc = (e & stride) == 0, (e & size) == 0
    return np.where(lower == desc, np.maximum(mine, other), np.minimum(mine, other))


def model_sort(c: np.ndarray, P: int) -> np.ndarray:
    """c: [THREADS·J] uint64, element e = j·THREADS + tid, as the kernel holds them."""
    c = c.copy()
    nj = (P + THREADS - 1) // THREADS
    live = np.arange(THREADS * J) < nj * THREADS  # slots j < nj take part (their exchanges run)
    e = np.arange(THREADS * J)
    size = 2
    while size <= P:
        stride = size // 2
        while stride > 0:
            if stride >= THREADS:  # in-thread: slots j and j | js, the lower one decides
                js = stride // THREADS
                new = c.copy()
                for j in range(J):
                    if (j & js) or (j | js) >= J or j >= nj:
                        continue
                    lo, hi = slice(j * THREADS, (j + 1) * THREADS), slice((j | js) * THREADS, ((j | js) + 1) * THREADS)
                    a, b = c[lo], c[hi]
                    swap = np.where((e[lo] & size) == 0, a < b, a > b)
                    new[lo], new[hi] = np.where(swap, b, a), np.where(swap, a, b)
                c = new
            else:  # shuffle or shared memory: every live element looks at e ^ stride
                other = c[e ^ stride]
                c = np.where(live, keep(c, other, e, stride, size), c)
            stride //= 2
        size *= 2
    return c


def composites(v: np.ndarray) -> np.ndarray:
    u = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    key = np.where(u & 0x80000000, ~u & 0xFFFFFFFF, u | 0x80000000)
    return (key << np.uint64(32)) | (np.uint64(0xFFFF) - np.arange(len(v), dtype=np.uint64))


@pytest.mark.parametrize("E", [1, 2, 3, 7, 8, 16, 31, 64, 100, 128, 129, 200, 256, 300, 384, 511, 512])
def test_register_bitonic_equals_a_plain_sort(E):
    rng = np.random.default_rng(E)
    for trial in range(4):
        v = rng.standard_normal(E).astype(np.float32)
        if trial % 2:  # ties, +-0, inf, NaN
            v = np.round(v * 2) / 2
            v[rng.integers(0, E, size=max(1, E // 8))] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan])
        comp = composites(v)
        c = np.zeros(THREADS * J, dtype=np.uint64)
        c[:E] = comp
        P = 1 if E <= 1 else 1 << (E - 1).bit_length()
        got = model_sort(c, P)
        want = np.sort(comp)[::-1]
        assert np.array_equal(got[:E], want), (E, trial)
        k = min(E, 32)  # the picks: position p is thread p's first slot
        ids = 0xFFFF - (got[:k] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        assert len(set(ids.tolist())) == k and ids.max() < E
