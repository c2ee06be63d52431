// epilogue/combine.cuh: the weighted sum of a row's k routes, for engines that store per-route outputs.
//
//   y     [R, H]     f32   per-route FC2 output (bias included, routing weight not yet applied)
//   ids   [R]        i32   expert of route r; -1: an expert this layer does not hold (expert slices [ext]),
//                          whose y was never written: skipped
//   topk_w [R]       f32   routing weights, route r = row*k + slot
//   out   [rows, H]  T     sum over slots (in slot order: deterministic) of topk_w * y, rounded once
#pragma once

#include "core/types.cuh"

namespace qmoe {

template <typename T>
__global__ void combine_routes(const float* __restrict__ y, const i32* __restrict__ ids, const float* __restrict__ topk_w, i32 rows,
                               i32 k, i32 H, T* __restrict__ out) {
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)rows * H) return;
  const i64 row = idx / H, n = idx - row * H;
  float total = 0.0f;
  for (i32 slot = 0; slot < k; ++slot) {
    const i64 r = row * k + slot;
    if (ids[r] >= 0) total = fmaf(topk_w[r], y[r * H + n], total);
  }
  out[idx] = Traits<T>::from_float(total);
}

}  // namespace qmoe
