// core/wg_order.cuh: the K order of the warpgroup-MMA engines' shared-memory operand, and the kernel
// that puts an input in it.
//
//   x   [rows, H]   T    the call's input
//   xp  [rows, Hp]  T    x with every 128-value chunk of K in wgmma order, zeros past H (Hp = H
//                        rounded up to 128)
//
// Why a permuted K: a tensor-core lane dequantizes 32 consecutive codes of two rows into MMA A pairs in
// the order the shifts produce them (core/mma_pair.cuh). wgmma reads B from shared memory in its own
// order, so the activations are stored already permuted: logical column l of a chunk holds natural
// k = wg_natural<B>(l). Both operands agree on every product, so the dot products are unchanged.
// The host mirror (tests): qmoe_rtc/kernels/wgmma_geometry.py wg_natural / wg_logical.
//
// Route-tile images (the wgmma kernels in clusters, engines/wgmma_prefill.cuh): rows in sorted route order,
// laid out as the shared-memory operand so one bulk copy brings a tile's half chunk:
//   img [Kp / 64][Rp][64] T    half q = logical k 64q .. 64q + 63 of sorted row p, its 16-byte unit u
//                              stored at unit u ^ ((p - m0) & 7), m0 the first row of p's route tile
//                              (the 128-byte swizzle wgmma reads); Rp = R + the largest route tile, the
//                              rows past R never written (a tile's copy reads them; their columns are
//                              never stored)
#pragma once

#include "core/codes.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"

namespace qmoe {

// Natural k (0..127) of logical column l of a chunk, and the inverse, for B-bit codes: logical
// column 16s + j of k16 step s is lane t = (j % 8) / 2's pair 2s + j / 8, low or high value j % 2.
// (Pairs as MmaDeq::low_code says: the tiled layout's pair i is natural codes 2i, 2i + 1.)
template <int B> __device__ __forceinline__ int wg_natural(int l) {
  using D = MmaDeq<__half, B>;
  const int s = l >> 4, j = l & 15, pair = 2 * s + (j >> 3);
  return 32 * ((j & 7) >> 1) + D::low_code(pair) + (j & 1) * D::kPairStep;
}
template <int B> __device__ __forceinline__ int wg_logical(int n) {
  constexpr int P = MmaDeq<__half, B>::kPairsPerWord, C = MmaDeq<__half, B>::kCodesPerWord;
  const int t = n >> 5, r = n & 31, w = r % C;
  const int pair = kTiled ? r >> 1 : (r / C) * P + w % P, hi = kTiled ? r & 1 : w / P;
  return 16 * (pair >> 1) + 8 * (pair & 1) + 2 * t + hi;
}
// Where natural column o of a row goes in the permuted layout.
template <int B> __device__ __forceinline__ i32 wg_pos(i32 o) { return (o & ~127) + wg_logical<B>(o & 127); }

// xp[r, c·128 + l] = x[r, c·128 + wg_natural<B>(l)], zero past K: thread i of `stride` threads (at least
// rows·Hp / 8 of them) writes 8 values of xp. Also zeroes the first y_zero floats of y (a multiple of 4; 0: none), for
// an FC2 that adds its halves of K into y (engines/wgmma_prefill.cuh: wg_prepare, wg_route_group, fc2_wgmma).
template <typename T, int B>
__device__ __forceinline__ void wg_permute_rows(const T* __restrict__ x, i32 rows, i32 H, i32 Hp, T* __restrict__ xp,
                                                float* __restrict__ y, i64 y_zero, i64 i, i64 stride) {
  const i32 units = Hp / 8;
  for (i64 j = i; j < y_zero / 4; j += stride) reinterpret_cast<float4*>(y)[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (i >= (i64)rows * units) return;
  const i64 r = i / units;
  const i32 u = (i32)(i - r * units), c0 = (u >> 4) * 128, l0 = (u & 15) * 8;
  const u16* src = reinterpret_cast<const u16*>(x) + r * H;
  u32 v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const i32 n0 = c0 + wg_natural<B>(l0 + 2 * j), n1 = c0 + wg_natural<B>(l0 + 2 * j + 1);
    v[j] = (u32)(n0 < H ? src[n0] : 0) | ((u32)(n1 < H ? src[n1] : 0) << 16);
  }
  *reinterpret_cast<uint4*>(xp + r * Hp + u * 8) = make_uint4(v[0], v[1], v[2], v[3]);
}

// Element index in a route-tile image of logical column l (0 .. Kp) of sorted row p, `swz` = (p - m0) & 7.
__device__ __forceinline__ i64 img_index(i32 p, i32 swz, i32 l, i32 Rp) {
  return ((i64)(l >> 6) * Rp + p) * 64 + ((((l >> 3) & 7) ^ swz) << 3) + (l & 7);
}

}  // namespace qmoe
