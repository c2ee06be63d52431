// engines/ring_smem.cuh: the dynamic shared memory of the ring engines' launches (engines/mma_ring.cuh): what the
// decode kernels' blocks hold (rings, route lists, x rings), whether a GEMM's rings take the bytes the host sized
// them with, and the checks that trap on a launch smaller than that.
#pragma once

#include "core/types.cuh"
#include "engines/mma_stage.cuh"
#include "engines/x_ring.cuh"

namespace qmoe {

// Dynamic shared memory of a decode launch with R routes: kMmaWarps rings of kMmaStages stages, then
// the block's two route lists (R ids each). The host sizes the launch so (kernels/mma_decode.py
// decode_smem_bytes); a smaller launch is a host bug: trap, never overrun.
// With xs > 0, the warps' x rings follow (engines/x_ring.cuh), 16-byte aligned (mma_x_rings): xs route lanes'
// parts of kMmaStages·KST chunk slots each.
template <class Stage> using MmaXRing = XRing<kMmaStages * Stage::KST>;
template <class Stage> constexpr u32 mma_x_rings(i32 R) {
  return (kMmaWarps * kMmaStages * Stage::kBytes + 8u * R + 15u) & ~15u;
}
template <class Stage> constexpr u32 mma_x_ring_bytes(i32 xs) { return (u32)(xs * MmaXRing<Stage>::kLaneBytes); }
template <class Stage> constexpr u32 mma_smem_bytes(i32 R, i32 xs = 0) {
  return xs > 0 ? mma_x_rings<Stage>(R) + kMmaWarps * mma_x_ring_bytes<Stage>(xs)
                : (u32)(kMmaWarps * kMmaStages * Stage::kBytes) + 8u * (u32)R;
}
// Whether a GEMM's four rings of Stage take the bytes the host sized its launch with (kernels/mma_decode.py
// ring_bytes: QMOE_MMA_FC1_RING, QMOE_MMA_FC2_RING), with the blocks an SM its route tile's kernels are set for.
template <class Stage, int BR> constexpr bool mma_ring_is(int host) {
  return kMmaWarps * kMmaStages * Stage::kBytes == host && mma_min_blocks<BR>() > 0;
}
template <class Stage> __device__ __forceinline__ void check_ring_size(i32 R, i32 xs = 0) {
  u32 have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < mma_smem_bytes<Stage>(R, xs)) __trap();
}

}  // namespace qmoe
