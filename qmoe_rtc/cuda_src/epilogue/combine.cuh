// epilogue/combine.cuh: the weighted sum of a row's k routes, for engines that store per-route outputs.
//
//   y     [P, R, H]  f32   per-route FC2 output (bias included, routing weight not yet applied), in P = parts planes
//                          `plane` values apart (an FC2 split over K: plane p holds part p's sums); usually P = 1
//   ids   [R]        i32   expert of route r; -1: an expert this layer does not hold (expert slices [ext]),
//                          whose y was never written: skipped
//   topk_w [R]       f32   routing weights, route r = row*k + slot
//   out   [rows, H]  T     sum over slots (in slot order: deterministic) of topk_w * y, rounded once
//
// Launch: grid (rows, ceil(H / (kCombineCols·blockDim.x))); a thread owns kCombineCols consecutive columns of one
// row. The loads of kCombineSlots slots are issued before their FMAs (the kernel is a stream of R·H·4 bytes: one
// 4-byte load at a time per thread moved 168 MB in 107.6 µs at mixtral 4096, 1.6 TB/s; this way 46.2 µs). With H a
// multiple of 8 and y / out 16-byte aligned every load and store is a 16-byte vector; otherwise scalar, bounded by
// H. Either way each value is fmaf(w, y, total) from 0 in slot order, y its planes added in plane order: the same
// bits.
// It may be launched overlapping the FC2 before it (core/pdl.cuh): it waits for it before reading y.
#pragma once

#include "core/pdl.cuh"
#include "core/types.cuh"

namespace qmoe {

inline constexpr int kCombineCols = 8;
inline constexpr int kCombineSlots = 4;

template <typename T>
__global__ void combine_routes(const float* __restrict__ y, i32 parts, i64 plane, const i32* __restrict__ ids,
                               const float* __restrict__ topk_w, i32 rows, i32 k, i32 H, T* __restrict__ out) {
  pdl_wait();  // y, ids and topk_w are earlier kernels' (a no-op unless launched overlapped)
  const i64 row = blockIdx.x;
  const i32 n0 = ((i32)blockIdx.y * (i32)blockDim.x + (i32)threadIdx.x) * kCombineCols;
  if (row >= rows || n0 >= H) return;
  const bool vec = (H % kCombineCols) == 0 && is_aligned(y, 16) && is_aligned(out, 16);
  float total[kCombineCols];
#pragma unroll
  for (int i = 0; i < kCombineCols; ++i) total[i] = 0.0f;
  for (i32 s0 = 0; s0 < k; s0 += kCombineSlots) {
    float v[kCombineSlots][kCombineCols];
    float w[kCombineSlots];
    bool live[kCombineSlots];
#pragma unroll
    for (int b = 0; b < kCombineSlots; ++b) {
      const i64 r = row * k + s0 + b;
      live[b] = s0 + b < k && ids[r] >= 0;
      w[b] = live[b] ? topk_w[r] : 0.0f;
      const float* yr = y + r * H + n0;
      if (live[b] && vec) {
        load8_f32<float, true>(yr, v[b]);
      } else {
#pragma unroll
        for (int i = 0; i < kCombineCols; ++i) v[b][i] = live[b] && n0 + i < H ? yr[i] : 0.0f;
      }
    }
    for (i32 p = 1; p < parts; ++p)  // the other planes, in order
#pragma unroll
      for (int b = 0; b < kCombineSlots; ++b) {
        if (!live[b]) continue;
        const float* yr = y + p * plane + (row * k + s0 + b) * H + n0;
        float u[kCombineCols];
        if (vec) {
          load8_f32<float, true>(yr, u);
        } else {
#pragma unroll
          for (int i = 0; i < kCombineCols; ++i) u[i] = n0 + i < H ? yr[i] : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < kCombineCols; ++i) v[b][i] += u[i];
      }
#pragma unroll
    for (int b = 0; b < kCombineSlots; ++b)
      if (live[b]) {
#pragma unroll
        for (int i = 0; i < kCombineCols; ++i) total[i] = fmaf(w[b], v[b][i], total[i]);
      }
  }
  T* o = out + row * H + n0;
  if (vec) {
    store8_f32<T, true>(o, total);
  } else {
#pragma unroll
    for (int i = 0; i < kCombineCols; ++i)
      if (n0 + i < H) store_f32(o + i, total[i]);
  }
}

}  // namespace qmoe
