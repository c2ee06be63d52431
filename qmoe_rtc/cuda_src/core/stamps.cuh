// core/stamps.cuh: where a block's time goes, for diagnostics only (QMOE_RTC_PREFILL_WG_STAMPS=1 compiles
// the wgmma prefill engine with -DQMOE_WG_STAMPS=1; tools/wg_stamps.py reads the table back).
//
// qmoe_wg_stamps [2 kernels (FC1, FC2)][kStampBlocks blocks][8] i64, thread 0 of each block:
//   0 cycles from entry to the main loop (tile lookup, row pointers, first copies issued)
//   1 cycles in the main loop
//   2 of which waiting: cp.async wait + fence + the chunk's __syncthreads
//   3 cycles from the main loop to exit (epilogue stores)
//   4 chunks of the main loop     5 SM id     6, 7 %globaltimer (ns) at entry and exit
// Without the define every member is empty and the engines compile exactly as before.
#pragma once

#include "core/types.cuh"

#ifndef QMOE_WG_STAMPS
#define QMOE_WG_STAMPS 0
#endif

namespace qmoe {

inline constexpr int kStampBlocks = 1 << 16;

#if QMOE_WG_STAMPS
extern "C" {
__device__ long long qmoe_wg_stamps[2][kStampBlocks][8];  // a definition: braces, not `extern "C" decl`
}

__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

struct Stamps {
  long long entry, ns0, loop0, loop1, waited, w0;
  __device__ __forceinline__ void start() {
    entry = clock64();
    ns0 = global_ns();
    waited = 0;
  }
  __device__ __forceinline__ void loop_start() { loop0 = clock64(); }
  __device__ __forceinline__ void wait_start() { w0 = clock64(); }
  __device__ __forceinline__ void wait_end() { waited += clock64() - w0; }
  __device__ __forceinline__ void loop_end() { loop1 = clock64(); }
  __device__ __forceinline__ void store(int kernel, int chunks) {
    if (threadIdx.x != 0 || blockIdx.x >= kStampBlocks) return;
    u32 sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    long long* s = qmoe_wg_stamps[kernel][blockIdx.x];
    s[0] = loop0 - entry;
    s[1] = loop1 - loop0;
    s[2] = waited;
    s[3] = clock64() - loop1;
    s[4] = chunks;
    s[5] = sm;
    s[6] = ns0;
    s[7] = global_ns();
  }
};
#else
struct Stamps {
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void loop_start() {}
  __device__ __forceinline__ void wait_start() {}
  __device__ __forceinline__ void wait_end() {}
  __device__ __forceinline__ void loop_end() {}
  __device__ __forceinline__ void store(int, int) {}
};
#endif

}  // namespace qmoe
