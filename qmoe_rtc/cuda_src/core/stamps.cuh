// core/stamps.cuh: where a block's time goes, for diagnostics only. Without their define every member below is
// empty and the engines compile exactly as before.
//
// Stamps (QMOE_RTC_TUNE=prefill_wg_stamps=1 compiles the wgmma prefill engine with -DQMOE_WG_STAMPS=1;
// tools/stamps.py wgmma reads the table back):
// qmoe_wg_stamps [2 kernels (FC1, FC2)][kStampBlocks blocks][8] i64, thread 0 of each block:
//   0 cycles from entry to the main loop (tile lookup, row pointers, first copies issued)
//   1 cycles in the main loop
//   2 of which waiting: cp.async wait + fence + the chunk's __syncthreads
//   3 cycles from the main loop to exit (epilogue stores)
//   4 chunks of the main loop     5 SM id     6, 7 %globaltimer (ns) at entry and exit
//
// DecodeStamps (QMOE_RTC_TUNE=decode_stamps=1 compiles the decode engine with -DQMOE_DECODE_STAMPS=1, its two
// kernels in one program so they share the table; tools/stamps.py decode reads it back): the chain's timeline,
// %globaltimer (ns) at each step of a block, thread 0 of each block b = blockIdx.y · gridDim.x + blockIdx.x:
// qmoe_decode_stamps [2 kernels (FC1, FC2)][kStampBlocks blocks][6] i64:
//   0 entry   1 its input is there (FC1: after griddepcontrol.wait, the routing done; FC2: its route scan done)
//   2 its routes known and (FC2) its expert's FC1 tiles written: the weight loop starts
//   3 the loop and its stores done   4 exit (FC2: after the tile's combine, where this block does it)
//   5 routes served (0: a block whose route is not its expert's first) | SM id << 32
// A block that leaves at its route scan stores 2, 3 and 4 as its exit.
#pragma once

#include "core/types.cuh"

#ifndef QMOE_WG_STAMPS
#define QMOE_WG_STAMPS 0
#endif

namespace qmoe {

inline constexpr int kStampBlocks = 1 << 16;

#ifndef QMOE_DECODE_STAMPS
#define QMOE_DECODE_STAMPS 0
#endif

#if QMOE_WG_STAMPS || QMOE_DECODE_STAMPS
__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u32 sm_id() {
  u32 sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  return sm;
}
#endif

#if QMOE_WG_STAMPS
extern "C" {
__device__ long long qmoe_wg_stamps[2][kStampBlocks][8];  // a definition: braces, not `extern "C" decl`
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
    const u32 sm = sm_id();
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

#if QMOE_DECODE_STAMPS
extern "C" {
__device__ long long qmoe_decode_stamps[2][kStampBlocks][6];  // a definition, as qmoe_wg_stamps
}

struct DecodeStamps {
  long long t[5];
  __device__ __forceinline__ void start() { t[0] = global_ns(); }
  __device__ __forceinline__ void mark(int i) { t[i] = global_ns(); }
  // thread 0 writes the block's row: `step` the last mark taken (later ones take the exit time)
  __device__ __forceinline__ void store(int kernel, int step, int routes) {
    const long long now = global_ns();
    const u32 b = blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x != 0 || b >= (u32)kStampBlocks) return;
    long long* s = qmoe_decode_stamps[kernel][b];
#pragma unroll
    for (int i = 0; i < 5; ++i) s[i] = i == 0 || i <= step ? t[i] : now;
    s[5] = (long long)routes | ((long long)sm_id() << 32);
  }
};
#else
struct DecodeStamps {
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ void store(int, int, int) {}
};
#endif

}  // namespace qmoe
