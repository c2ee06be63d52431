"""How fast can the decode engine's weight stream go, with no arithmetic? (issue 13's diagnosis tool)

Reads one buffer shaped like mixtral-8x7b's FC1 weights at 1 token (two experts: [2·2·14336 rows,
4096 int4 codes] = 117 MB, ``--rows``/``--row-bytes`` to change) with kernels that do nothing but
stream it, L2 flushed before each timed sample, median of ``--iters`` CUDA-event samples:

- ``coalesced``: every thread reads consecutive 16-byte words (grid-stride): what the memory can do.
- ``rows S/B``: the decode engine's pattern (``engines/mma_ring.cuh``) -- a block of 4 warps, each
  warp 16 weight rows, each lane 2 × 16 bytes of each of its two rows per stage through an S-stage
  cp.async ring in shared memory; B resident blocks per SM (padded shared memory), one block per
  64-row tile, as FC1's grid is.
- ``tiles S/B``: the same ring and grid, but a warp's stage is one contiguous 2 KiB run (the layout a
  repacked weight tensor would give).

    python3 tools/stream_probe.py [--iters 30]

Prints GB/s and the share of the coalesced rate for each; nothing is written.
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp

SRC = r"""
extern "C" __global__ void coalesced(const uint4* __restrict__ p, long long n, unsigned* out) {
  unsigned acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// TILED = 0: rows (row-major weights, lane reads 16 B of each of its 2 rows per chunk, 2 chunks a stage)
// TILED = 1: a warp's stage is one contiguous 2 KiB run
template <int TILED, int stages>
__device__ void ring(const unsigned char* __restrict__ w, long long row_bytes, unsigned* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const long long row0 = ((long long)blockIdx.x * 4 + warp) * 16;  // the warp's 16 rows
  const int nst = (int)(row_bytes / 128);                            // stages: 128 bytes of each row
  const unsigned base = (unsigned)__cvta_generic_to_shared(smem) + warp * stages * 2048;
  auto issue = [&](int slot, int s) {
    for (int u = 0; u < 2; ++u)
      for (int r = 0; r < 2; ++r) {
        const unsigned char* src;
        if (TILED) src = w + (row0 * row_bytes) + (long long)s * 2048 + ((u * 2 + r) * 32 + lane) * 16;
        else src = w + (row0 + g + 8 * r) * row_bytes + s * 128 + u * 64 + t * 16;
        const unsigned dst = base + slot * 2048 + ((u * 2 + r) * 32 + lane) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
      }
  };
  unsigned acc = 0;
  for (int i = 0; i < stages - 1; ++i) {
    if (i < nst) issue(i, i);
    asm volatile("cp.async.commit_group;");
  }
  for (int s = 0; s < nst; ++s) {
    asm volatile("cp.async.wait_group %0;" ::"n"(stages - 2));  // stage s has landed
    if (s + stages - 1 < nst) issue((s + stages - 1) % stages, s + stages - 1);
    asm volatile("cp.async.commit_group;");
    const uint4* st = reinterpret_cast<const uint4*>(smem + warp * stages * 2048 + (s % stages) * 2048);
    for (int q = 0; q < 4; ++q) { uint4 v = st[q * 32 + lane]; acc ^= v.x ^ v.y ^ v.z ^ v.w; }
  }
  asm volatile("cp.async.wait_group 0;");
  if (acc == 0x9e3779b9u) out[0] = acc;
}
#define PROBE(S) \
  extern "C" __global__ void rows##S(const unsigned char* w, long long rb, unsigned* out) { ring<0, S>(w, rb, out); } \
  extern "C" __global__ void tiles##S(const unsigned char* w, long long rb, unsigned* out) { ring<1, S>(w, rb, out); }
PROBE(3)
PROBE(4)
PROBE(6)
"""


def timed(fn, iters: int, flush) -> float:
    for _ in range(3):
        fn()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        flush.fill(i & 0xFF)
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in ev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2 * 2 * 14336)
    ap.add_argument("--row-bytes", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    a = ap.parse_args()
    if a.rows % 64 or a.row_bytes % 128:
        raise SystemExit(f"--rows must be a multiple of 64 and --row-bytes of 128 (got {a.rows}, {a.row_bytes})")
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    w = cp.random.RandomState(0).randint(0, 255, a.rows * a.row_bytes, dtype=cp.uint8)
    out = cp.zeros(1, cp.uint32)
    flush = cp.empty(256 << 20, cp.uint8)
    nbytes = w.nbytes
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    smem_sm = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
    k = mod.get_function("coalesced")
    us = timed(lambda: k((sms * 8,), (256,), (w, cp.int64(nbytes // 16), out)), a.iters, flush)
    base = nbytes / us / 1e3
    print(f"{nbytes / 1e6:.1f} MB, {sms} SMs; coalesced: {us:.1f} us, {base:.0f} GB/s")
    for name in ("rows", "tiles"):
        for stages in (3, 4, 6):
            f = mod.get_function(f"{name}{stages}")
            for per_sm in (5, 8, 12):
                ring = 4 * stages * 2048
                smem = max(ring, smem_sm // per_sm - 1024)  # pad so at most per_sm blocks fit
                if smem > 227 * 1024 or ring * per_sm > smem_sm:
                    continue
                f.max_dynamic_shared_size_bytes = smem
                us = timed(lambda f=f, smem=smem: f((a.rows // 64,), (128,), (w, cp.int64(a.row_bytes), out),
                                                    shared_mem=smem), a.iters, flush)
                gbs = nbytes / us / 1e3
                print(f"{name:5s} stages {stages} blocks/SM {per_sm:2d}: {us:7.1f} us {gbs:6.0f} GB/s "
                      f"{100 * gbs / base:5.1f} % of coalesced")


if __name__ == "__main__":
    main()
