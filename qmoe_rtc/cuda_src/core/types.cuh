// core/types.cuh: integer aliases and the activation-type traits every qmoe kernel uses.
//
// NVRTC has no <cstdint>; these aliases are the only integer names the templates use.
// Traits<T> converts between the storage type T (float, __half, __nv_bfloat16) and float32,
// which is the type every qmoe computation is carried out in.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace qmoe {

// Namespace-scope constants of every header are `inline constexpr`: a plain `constexpr` gets internal
// linkage, and NVRTC names such a symbol with a per-compile id, so two compiles of one unit gave
// different cubins (same SASS). tests/package/test_code_health.py keeps it so.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

// kSame<A, B>: whether A and B are one type (NVRTC has no <type_traits>)
template <typename A, typename B> inline constexpr bool kSame = false;
template <typename A> inline constexpr bool kSame<A, A> = true;

template <typename T> struct Traits;

template <> struct Traits<float> {
  static constexpr int kBytes = 4;
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};

template <> struct Traits<__half> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <> struct Traits<__nv_bfloat16> {
  static constexpr int kBytes = 2;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

// Round a float32 to T (round-to-nearest-even) and store it.
template <typename T> __device__ __forceinline__ void store_f32(T* p, float v) {
  *p = Traits<T>::from_float(v);
}

// Store 8 consecutive float32 values as T. VEC: p is aligned to 8*sizeof(T) bytes (one 16-byte
// store for half/bf16, two for float); otherwise eight scalar stores.
template <typename T, bool VEC> __device__ __forceinline__ void store8_f32(T* p, const float (&v)[8]) {
  if constexpr (VEC && Traits<T>::kBytes == 4) {
    float4* q = reinterpret_cast<float4*>(p);
    q[0] = make_float4(v[0], v[1], v[2], v[3]);
    q[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else if constexpr (VEC && Traits<T>::kBytes == 2) {
    union { T t[8]; uint4 u; } pack;
#pragma unroll
    for (int i = 0; i < 8; ++i) pack.t[i] = Traits<T>::from_float(v[i]);
    *reinterpret_cast<uint4*>(p) = pack.u;
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = Traits<T>::from_float(v[i]);
  }
}

// Load 8 consecutive T as float32. VEC: p aligned to 8*sizeof(T) bytes.
template <typename T, bool VEC> __device__ __forceinline__ void load8_f32(const T* p, float (&v)[8]) {
  if constexpr (VEC && Traits<T>::kBytes == 4) {
    const float4* q = reinterpret_cast<const float4*>(p);
    float4 a = q[0], b = q[1];
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else if constexpr (VEC && Traits<T>::kBytes == 2) {
    union { T t[8]; uint4 u; } pack;
    pack.u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = Traits<T>::to_float(pack.t[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = Traits<T>::to_float(p[i]);
  }
}

// True when p is aligned to `bytes` (a power of two).
__device__ __forceinline__ bool is_aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<u64>(p) & (u64)(bytes - 1)) == 0;
}

}  // namespace qmoe
