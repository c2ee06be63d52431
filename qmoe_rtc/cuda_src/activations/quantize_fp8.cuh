// activations/quantize_fp8.cuh: FP8 activations [ext] (docs/contract.md, "FP8 activations"): a GEMM's input rows
// rounded to float8 e4m3fn with a dynamic scale per group of g values along K (g = K: a scale a row), the codes and
// scales qmoe_rtc/formats/activations.py defines, bit for bit.
//
//   x       [rows, K]            T     input rows
//   codes   [rows, K]            u8    e4m3fn: the code nearest fl32(v / s) clamped to ±448 (cvt.rn.satfinite)
//   scales  [rows, ceil(K / g)]  f32   s = fl32(amax / 448), 1 for an all-zero group; NaN for a group holding a
//                                      NaN or ±inf (its codes: the group's with those values read as zero)
//
// One block of kQuantThreads per (group, row), grid (ceil(K / g), rows): the block's amax by warp maxima and a
// shared slot a warp, then each thread converts its values. sm_89+ (the e4m3 conversion).
#pragma once

#include "core/types.cuh"

namespace qmoe {

inline constexpr int kQuantThreads = 256;
inline constexpr float kE4m3Max = 448.0f;

// The e4m3fn code of q (|q| <= 448 here), rounded to nearest even.
__device__ __forceinline__ u8 e4m3_code(float q) {
  u16 two;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(0.0f), "f"(q));  // q: the low byte
  return (u8)(two & 0xffu);
}

template <typename T>
__global__ void __launch_bounds__(kQuantThreads)
quantize_fp8_rows(const T* __restrict__ x, i32 K, i32 g, u8* __restrict__ codes, float* __restrict__ scales) {
  __shared__ float s_amax[kQuantThreads / 32];
  __shared__ int s_bad[kQuantThreads / 32];
  const i64 row = blockIdx.y;
  const i32 k0 = blockIdx.x * g, k1 = min(k0 + g, K);
  const T* xr = x + row * K;
  float amax = 0.0f;
  bool bad = false;
  for (i32 i = k0 + (i32)threadIdx.x; i < k1; i += kQuantThreads) {
    const float v = Traits<T>::to_float(xr[i]);
    if (isfinite(v)) amax = fmaxf(amax, fabsf(v));
    else bad = true;
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  bad = __any_sync(0xffffffffu, bad);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
    s_amax[warp] = amax;
    s_bad[warp] = bad;
  }
  __syncthreads();
  float m = 0.0f;
  int any_bad = 0;
#pragma unroll
  for (int w = 0; w < kQuantThreads / 32; ++w) {
    m = fmaxf(m, s_amax[w]);
    any_bad |= s_bad[w];
  }
  const float s = m > 0.0f ? __fdiv_rn(m, kE4m3Max) : 1.0f;  // the scale of the group's finite values
  if (threadIdx.x == 0) scales[row * gridDim.x + blockIdx.x] = any_bad ? __int_as_float(0x7fc00000) : s;
  u8* cr = codes + row * K;
  for (i32 i = k0 + (i32)threadIdx.x; i < k1; i += kQuantThreads) {
    const float v = Traits<T>::to_float(xr[i]);
    const float q = isfinite(v) ? fminf(fmaxf(__fdiv_rn(v, s), -kE4m3Max), kE4m3Max) : 0.0f;
    cr[i] = e4m3_code(q);
  }
}

}  // namespace qmoe
