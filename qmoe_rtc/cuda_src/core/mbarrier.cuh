// core/mbarrier.cuh: shared-memory barriers with phases (sm_90), the hand-off of a ring's stages between the
// warps that fill them and the warps that read them (engines/wg_mainloop.cuh).
//
// A barrier counts arrivals; when the count set at init is reached its phase completes and the next
// one begins. mbar_wait(b, parity) returns once the phase with that parity has completed: waiting for
// parity 1 on a fresh barrier returns at once (the phase "before" phase 0), which lets a ring's
// producer treat every slot as free on its first pass. cp_async_arrive makes the barrier count one
// arrival of this thread when all of its earlier cp.async copies have landed (the .noinc form: the
// init count includes that thread).
#pragma once

#include "core/types.cuh"

namespace qmoe {

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(u32 bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// mbar_arrive when `pred` holds, without a branch (a branch between warpgroup MMAs makes ptxas
// serialize them: warning C7513).
__device__ __forceinline__ void mbar_arrive_if(u32 bar, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
               "r"((u32)pred)
               : "memory");
}

__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

// Arrive on `bar` and add `bytes` to the transfer count its phase waits for (the bulk copies that
// complete_tx on it).
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// mbar_arrive_expect_tx when `pred` holds, without a branch (as mbar_arrive_if).
__device__ __forceinline__ void mbar_arrive_expect_tx_if(u32 bar, u32 bytes, bool pred) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes), "r"((u32)pred)
               : "memory");
}

// One bulk copy (the TMA unit's 1D mode) of `bytes` (a multiple of 16; both addresses 16-byte aligned)
// from global memory to shared memory; its bytes count down the transfer count of `bar`.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads') over `threads` threads (a multiple of 32).
__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Generic-proxy writes to shared memory (cp.async included) made visible to the async proxy (wgmma's
// shared-memory operand) for the MMAs this thread issues next.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

}  // namespace qmoe
