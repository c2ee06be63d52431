// core/cp_async.cuh: asynchronous global -> shared copies (sm_80+), 4, 8 or 16 bytes, zero-filling
// when the source is not valid (nothing is read then).
#pragma once

#include "core/types.cuh"

namespace qmoe {

__device__ __forceinline__ void cp_async(u32 dst, const void* src, int bytes, bool valid) {
  const int n = valid ? bytes : 0;  // 0: zero-fill, nothing read
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(n));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(n));
}
// A lane's 32 codes of one row (CB = 4·B bytes, aligned to min(16, CB) bytes; 3-bit: 12 bytes,
// 4-byte aligned, as three 4-byte copies).
template <int CB> __device__ __forceinline__ void cp_async_codes(u32 dst, const u8* src, bool valid) {
  if constexpr (CB == 12) {
#pragma unroll
    for (int q = 0; q < 3; ++q) cp_async(dst + 4 * q, src + 4 * q, 4, valid);
  } else {
    static_assert(CB <= 16 || CB % 16 == 0, "4·B code bytes");
#pragma unroll
    for (int q = 0; q < (CB + 15) / 16; ++q) cp_async(dst + 16 * q, src + 16 * q, CB < 16 ? CB : 16, valid);
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }


}  // namespace qmoe
