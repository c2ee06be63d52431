// engines/x_ring.cuh: the activations of a decode warp's routes, staged in shared memory by the same
// cp.async groups as its weights (engines/mma_ring.cuh), so the product of a chunk never waits on a global
// load of its activations: they arrive with the chunk's codes, S - 1 stages ahead.
//
// Used by the decode kernels' x-ring pair (fc1_br8_xr / fc2_br8_xr: one route group, one row tile; calls of up to
// kernels/mma_decode.py X_RING_TOKENS tokens) for the first `xs` route lanes g = lane / 4: the host passes xs = the
// call's tokens, the most routes an expert can have (a token's k routes name k different experts; the kernels trap
// on more). A warp's x ring, SLOTS = S·KST chunk slots of its ring, 2-byte activations:
//   x [xs route lanes][SLOTS][4 lanes t][64 bytes] T, each route lane's part padded by 32 bytes
// lane (g, t) copies its 32 activations of chunk c (codes c·128 + 32t …, 64 bytes) as four 16-byte pieces.
// No address depends on xs: a lane's part starts at g·kLaneBytes + 64t (g clamped to xs − 1, inside the ring).
// Lanes past xs hold no route: they copy and read nothing (zeros). Each lane reads only what it copied, so no
// barrier. Zero-filled past K or without a route. The host sizes it (kernels/mma_decode.py x_ring_bytes).
#pragma once

#include "core/types.cuh"

namespace qmoe {

template <int SLOTS> struct XRing {
  static constexpr int kChunkBytes = 256;                      // 128 activations of 2 bytes of one route lane
  static constexpr int kLaneBytes = SLOTS * kChunkBytes + 32;  // a route lane's part (+32: banks of the next)
  u32 base;  // shared address of the lane's part, chunk slot 0
  static __device__ __forceinline__ XRing of(const u8* ring, i32 xs, i32 lane) {
    const i32 g = min(lane >> 2, xs - 1);
    return XRing{(u32)__cvta_generic_to_shared(ring) + (u32)(g * kLaneBytes + (lane & 3) * 64)};
  }
  // L1: through L1 (the layer's input: the blocks of an SM share it); else through L2 only (FC1's output,
  // which another grid may still be writing while this one runs). ok = false: zero-fill, nothing read.
  template <bool L1> __device__ __forceinline__ void issue(i32 chunk_slot, const u8* from, bool ok) const {
    const int n = ok ? 16 : 0;
    const u32 dst = base + (u32)chunk_slot * kChunkBytes;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if constexpr (L1)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst + 16 * q), "l"(from + 16 * q), "r"(n));
      else
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst + 16 * q), "l"(from + 16 * q), "r"(n));
    }
  }
  // Words 2s and 2s + 1 of the lane's 16 (k16 step s in the tiled layout's pair order, MmaDeq::x_pair): one
  // 8-byte load just before the step's mma; zeros on a lane without a route (live false).
  __device__ __forceinline__ uint2 step(i32 chunk_slot, int s, bool live) const {
    uint2 v = make_uint2(0u, 0u);
    if (live)
      asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];"
                   : "=r"(v.x), "=r"(v.y) : "r"(base + (u32)chunk_slot * kChunkBytes + 8 * s));
    return v;
  }
  // All 16 words (the contract layout's pairs take any two of them).
  __device__ __forceinline__ void read(i32 chunk_slot, u32 (&xw)[16]) const {
    const u32 src = base + (u32)chunk_slot * kChunkBytes;
#pragma unroll
    for (int q = 0; q < 4; ++q)
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(xw[4 * q]), "=r"(xw[4 * q + 1]), "=r"(xw[4 * q + 2]), "=r"(xw[4 * q + 3])
                   : "r"(src + 16 * q));
  }
};

}  // namespace qmoe
