// core/reduce.cuh: warp and block reductions (float32).
#pragma once

#include "core/types.cuh"

namespace qmoe {

inline constexpr u32 kFullMask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

// Sum over a block of THREADS threads (a multiple of 32, <= 1024). `smem` holds >= THREADS/32
// floats. Every thread gets the total. Contains __syncthreads(): call from all threads.
template <int THREADS> __device__ __forceinline__ float block_sum(float v, float* smem) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
  constexpr int kWarps = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if constexpr (kWarps == 1) return v;
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kWarps ? smem[lane] : 0.0f;
  return warp_sum(v);
}

// Max over a block; same contract as block_sum.
template <int THREADS> __device__ __forceinline__ float block_max(float v, float* smem) {
  static_assert(THREADS % 32 == 0 && THREADS <= 1024, "THREADS must be a multiple of 32, <= 1024");
  constexpr int kWarps = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max(v);
  if constexpr (kWarps == 1) return v;
  __syncthreads();
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kWarps ? smem[lane] : __int_as_float(0xff800000);  // -inf
  return warp_max(v);
}

}  // namespace qmoe
