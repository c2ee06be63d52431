// routing/bitonic.cuh: a descending bitonic sort of up to THREADS·J 64-bit keys held in registers.
//
// Element e = j·THREADS + tid is thread tid's c[j]; P (a power of two) elements take part, the rest
// must be keys no real one is below (0). The compare-exchange network is the textbook one -- runs of
// `size` alternate direction and the last run is descending -- so the order is the same as sorting
// the keys in shared memory; only the exchanges move: strides below 32 are warp shuffles (no
// barrier), 32 .. THREADS/2 go through shared memory (two barriers), THREADS and above stay inside a
// thread. At P = 128 that is 3 barrier steps of 28 instead of 28; at 512, 7 of 45.
#pragma once

#include "core/types.cuh"

namespace qmoe {

// Keep the larger key where this element is the lower one of a descending pair (or the upper one of an
// ascending pair), the smaller otherwise.
__device__ __forceinline__ u64 bitonic_keep(u64 mine, u64 other, i32 e, i32 stride, i32 size) {
  const bool lower = (e & stride) == 0, desc = (e & size) == 0;
  const u64 hi = mine > other ? mine : other, lo = mine > other ? other : mine;
  return lower == desc ? hi : lo;
}

// Pairs (j, j + JS) of one thread: stride JS·THREADS.
template <int THREADS, int JS, int J>
__device__ __forceinline__ void bitonic_in_thread(u64 (&c)[J], i32 nj, i32 size) {
#pragma unroll
  for (int j = 0; j < J; ++j) {
    if ((j & JS) || (j | JS) >= J || j >= nj) continue;  // nj is a power of two >= 2·JS here
    const i32 e = j * THREADS + (i32)threadIdx.x;
    const u64 a = c[j], b = c[j | JS];
    if ((e & size) == 0 ? a < b : a > b) {
      c[j] = b;
      c[j | JS] = a;
    }
  }
}

// xchg: THREADS·J keys of shared memory. Every thread of the block calls this (it has barriers).
template <int THREADS, int J>
__device__ __forceinline__ void bitonic_sort_desc(u64 (&c)[J], i32 P, u64* xchg) {
  static_assert(J <= 4 && THREADS % 32 == 0, "in-thread strides of 1 and 2 slots only");
  const i32 tid = threadIdx.x, nj = (P + THREADS - 1) / THREADS;
  for (i32 size = 2; size <= P; size <<= 1) {
    for (i32 stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride >= THREADS) {
        if (stride == THREADS) bitonic_in_thread<THREADS, 1>(c, nj, size);
        else bitonic_in_thread<THREADS, 2>(c, nj, size);
        continue;
      }
      u64 other[J];
      if (stride >= 32) {
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (j < nj) xchg[j * THREADS + tid] = c[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (j < nj) other[j] = xchg[(j * THREADS + tid) ^ stride];
        __syncthreads();
      } else {
#pragma unroll
        for (int j = 0; j < J; ++j)
          if (j < nj) other[j] = __shfl_xor_sync(0xffffffffu, c[j], stride);
      }
#pragma unroll
      for (int j = 0; j < J; ++j)
        if (j < nj) c[j] = bitonic_keep(c[j], other[j], j * THREADS + tid, stride, size);
    }
  }
}

}  // namespace qmoe
