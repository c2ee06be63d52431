// engines/x_block.cuh: the activations of a batched block's route pass, copied once per block into shared memory
// and read there by every warp (engines/mma_ring.cuh with an XBlock): the warps of a block that compute different
// rows of the same K slice read the same activations, which they would otherwise load from global memory each,
// just before the MMAs that need them (the batched engine's long-scoreboard stalls, docs/performance-log.md).
//
// A ring of kMmaStages stages beside the warps' weight rings; stage i holds the block's chunks [i·step, (i+1)·step)
// (step = KS·KST: warp slice ks computes chunks ks + u·KS of it), each chunk the 128 activations of kRoutes routes:
//   x [kMmaStages][step][kRoutes][kRowBytes]  T (2 bytes)   a route's 256 bytes, then 32 of padding
// The block's 128 threads copy a stage together, 16 bytes each per (chunk, route group): thread tid copies unit
// tid % 16 of route tid / 16 + 8·gg. A lane (g, t) reads its route g + 8·gg's codes 32t … 32t + 31 (units 4t … 4t + 3).
// Units are stored swizzled (unit ^ (unit >> 3 & 1)) and a route's row is 18 units long, so the 8 lanes of a
// 16-byte load phase (two routes, four t) hit 8 different 4-bank groups. The copies are cp.async in the same groups
// as the stage's weights; a block barrier after each stage's wait makes every thread's copies visible and keeps a
// slot from being refilled while a warp still reads it. The host sizes it (kernels/mma_batched.py x_block_bytes).
#pragma once

#include "core/types.cuh"

namespace qmoe {

// No block-staged activations: each lane loads its own from global memory (the decode kernels, the x rings).
struct NoXBlock {
  static constexpr bool kOn = false;
};

template <int N8> struct XBlock {
  static constexpr bool kOn = true;
  static constexpr int kRoutes = 8 * N8;
  static constexpr int kRowBytes = 256 + 32;
  static constexpr int kChunkBytes = kRoutes * kRowBytes;
  static constexpr int kUnits = 16;  // 16-byte units of a route's chunk

  u32 base;           // shared address of stage 0, chunk 0
  i32 step;           // chunks a stage: KS·KST
  const u8* src[N8];  // activations (bytes) of route tid / 16 + 8·gg, or null (no route: zero-filled)
  const u8* any;      // a valid address for zero-filled copies (nothing is read from it)

  static __device__ __forceinline__ u32 unit_at(int unit) { return (u32)((unit ^ ((unit >> 3) & 1)) * 16); }
  __device__ __forceinline__ u32 chunk_at(i32 slot, i32 pos) const {
    return base + (u32)((slot * step + pos) * kChunkBytes);
  }

  // Thread tid's copies of the block's stage chunks [c0, c0 + step) into slot `slot` (chunks past nch: none;
  // codes past K: zeros). COHERENT: through L2 only (an input another grid may still be writing), else through L1.
  template <bool COHERENT> __device__ __forceinline__ void issue(i32 slot, i32 c0, i32 nch, i32 K) const {
    const i32 q = threadIdx.x & (kUnits - 1), r0 = threadIdx.x >> 4;  // 8 routes × 16 units per 128 threads
    for (i32 j = 0; j < step; ++j) {
      const i32 c = c0 + j;
      if (c >= nch) break;
      const i32 k0 = c * 128 + 8 * q;
#pragma unroll
      for (int gg = 0; gg < N8; ++gg) {
        const bool ok = src[gg] != nullptr && k0 < K;
        const u8* from = ok ? src[gg] + 2 * (i64)k0 : any;
        const u32 dst = chunk_at(slot, j) + (u32)((r0 + 8 * gg) * kRowBytes) + unit_at(q);
        const int n = ok ? 16 : 0;
        if constexpr (COHERENT)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(from), "r"(n));
        else
          asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(from), "r"(n));
      }
    }
  }
  // Lane (g, t)'s V units from unit v0 of its 64 bytes of route g + 8·gg in chunk `pos` of slot `slot`, as words.
  template <int W> __device__ __forceinline__ void read(i32 slot, i32 pos, int gg, int v0, u32 (&xw)[W]) const {
    const i32 lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32 row = chunk_at(slot, pos) + (u32)((g + 8 * gg) * kRowBytes);
#pragma unroll
    for (int v = 0; v < W / 4; ++v)
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(xw[4 * v]), "=r"(xw[4 * v + 1]), "=r"(xw[4 * v + 2]), "=r"(xw[4 * v + 3])
                   : "r"(row + unit_at(4 * t + v0 + v)));
  }
};

// The activations' source of a batched kernel: block-staged (ON, the host's choice: kernels/mma_batched.py) or not.
template <bool ON, int N8> struct XBlockOf {
  using type = NoXBlock;
};
template <int N8> struct XBlockOf<true, N8> {
  using type = XBlock<N8>;
};

// The shared memory of a block's x stages (ON) with a K split of KS warps: kMmaStages stages of KS·KST chunks.
template <bool ON, int N8> __host__ __device__ constexpr u32 x_block_bytes(i32 stages, i32 KS, i32 KST) {
  return ON ? (u32)(stages * KS * KST * XBlock<N8>::kChunkBytes) : 0u;
}

}  // namespace qmoe
