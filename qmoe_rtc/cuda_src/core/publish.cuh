// core/publish.cuh: a block's global stores handed to other blocks through a counter, published by one
// thread's release instead of a fence in every thread.
//
// Every thread of the block calls these after its stores. bar.sync orders each thread's stores before
// thread 0's counter update at the block's scope, and a release at the GPU's scope is cumulative: a block
// that acquires the counter (ld.acquire.gpu, or the acq_rel add below) and then reaches a bar.sync sees
// them all. A __threadfence() in every thread (fence.sc.gpu: MEMBAR.SC.GPU, ERRBAR, CCTL.IVALL, which also
// drops the SM's L1 lines every resident block shares) cost FC1 of mixtral-8x7b at 1 token 8.6 % of its
// warps' stall samples (ncu; docs/performance-log.md).
#pragma once

#include "core/types.cuh"

namespace qmoe {

// counter += 1 once the block's stores are visible to whoever acquires it.
__device__ __forceinline__ void block_publish_add(u32* counter) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counter) : "memory");
}

// counter += 1 as above; true (in every thread) for the block whose add made it `arrivals`: that block's
// threads then see every earlier block's published stores. `flag`: one bool of shared memory.
__device__ __forceinline__ bool block_publish_last(u32* counter, u32 arrivals, bool* flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    u32 old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    *flag = old == arrivals - 1u;
  }
  __syncthreads();
  return *flag;
}

}  // namespace qmoe
