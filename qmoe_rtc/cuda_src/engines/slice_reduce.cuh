// engines/slice_reduce.cuh: the K-slice reduction of the ring engines' blocks (engines/mma_ring.cuh): the KS
// warps that split one row tile's K add their C fragments in a fixed order (deterministic), through the
// rings' own shared memory.
#pragma once

#include "core/types.cuh"

namespace qmoe {

// Adds the KS slices' C fragments into the slice-0 warps (fixed order). Each warp's partial sums go
// to the start of its own ring (N8·512 bytes, smaller than a ring; its copies have all landed and
// been read when mma_rows returns), so the reduction needs no shared memory of its own.
template <int F> __device__ __forceinline__ void reduce_slices(float (&acc)[F][4], i32 mt, i32 ks, i32 MT, i32 KS,
                                                                u8* rings, i32 ring_bytes) {
  if (KS == 1) return;
  const i32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncwarp();  // every lane of this warp has read its ring
  if (ks > 0) {
    float* red = reinterpret_cast<float*>(rings + w * ring_bytes);
#pragma unroll
    for (int g = 0; g < F; ++g)
#pragma unroll
      for (int v = 0; v < 4; ++v) red[(g * 4 + v) * 32 + lane] = acc[g][v];
  }
  __syncthreads();
  if (ks == 0) {
    for (i32 s = 1; s < KS; ++s) {
      const float* red = reinterpret_cast<const float*>(rings + (s * MT + mt) * ring_bytes);
#pragma unroll
      for (int g = 0; g < F; ++g)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[g][v] += red[(g * 4 + v) * 32 + lane];
    }
  }
  __syncthreads();  // the rings are free again for the next route group
}

}  // namespace qmoe
