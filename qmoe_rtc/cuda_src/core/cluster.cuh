// core/cluster.cuh: thread block clusters (sm_90a): a block's rank, the cluster barrier, a barrier in the
// other block's shared memory, and a bulk copy written into every block of the cluster at once.
//
// The blocks of a cluster run at the same time on SMs of one GPC and may read, write and arrive on each
// other's shared memory (its addresses in the shared::cluster window: mapa). A block must not exit while
// another may still touch its shared memory: the engines' blocks arrive on the cluster barrier after their
// last copy and wait on it before they exit (cluster_arrive / cluster_wait).
//
// Compiled for other targets the wrappers trap (callers run on sm_90a only, as core/wgmma.cuh's).
#pragma once

#include "core/types.cuh"

namespace qmoe {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QMOE_CLUSTER_ASM(...) asm volatile(__VA_ARGS__)
#else
#define QMOE_CLUSTER_ASM(...) __trap()
#endif

// This block's rank in its cluster (0 .. cluster size - 1).
__device__ __forceinline__ u32 cluster_rank() {
  u32 r = 0;
  QMOE_CLUSTER_ASM("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of the cluster: arrive (release: this thread's earlier writes and arrivals, to any block's
// shared memory, are visible to whoever waits) / wait for every thread of the cluster to have arrived.
__device__ __forceinline__ void cluster_arrive() { QMOE_CLUSTER_ASM("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { QMOE_CLUSTER_ASM("barrier.cluster.wait.acquire;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// Barrier inits made visible to the other blocks of the cluster (before the cluster barrier that follows).
__device__ __forceinline__ void fence_mbar_init() { QMOE_CLUSTER_ASM("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The address in block `rank`'s shared memory of this block's shared address `a` (the same offset).
__device__ __forceinline__ u32 cluster_map(u32 a, u32 rank) {
  u32 r = 0;
  QMOE_CLUSTER_ASM("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}

// Arrive on the barrier at cluster address `bar` (cluster_map's) when `pred` holds, without a branch. The default
// semantics (release at the block's scope): it hands on a stage this block's MMAs finished reading (no data of
// this block's to publish); a release at the cluster's scope costs a GPU-wide memory barrier (MEMBAR.ALL.GPU).
__device__ __forceinline__ void mbar_arrive_cluster_if(u32 bar, bool pred) {
  QMOE_CLUSTER_ASM("{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cluster.b64 _, [%0];\n}\n" ::"r"(bar),
                   "r"((u32)pred)
                   : "memory");
}

// When `pred` holds (without a branch: core/mbarrier.cuh mbar_arrive_if), one bulk copy of `bytes` (a multiple of
// 16, both addresses 16-byte aligned) from global memory into the shared memory of every block in `mask` (bit r:
// rank r), at this block's offset `dst`; each block's barrier at the offset `bar` counts the bytes that land in it.
__device__ __forceinline__ void bulk_copy_multicast_if(u32 dst, const void* src, u32 bytes, u32 bar, u16 mask, bool pred) {
  QMOE_CLUSTER_ASM(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n"
      "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;\n}\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(mask), "r"((u32)pred)
      : "memory");
}

#undef QMOE_CLUSTER_ASM

}  // namespace qmoe
