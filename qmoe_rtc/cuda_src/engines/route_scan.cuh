// engines/route_scan.cuh: a decode block's routes (engines/mma_decode.cuh). A block belongs to (row tile, route r);
// its scan finds whether r is the first route of its expert and, if so, lists every route of that expert.
//
//   ids     [R]  i32  the routing kernel's ids (global; read through L2), unless s_ids is already filled
//   s_ids   [R]  i32  (shared) the ids: loaded here, or routed by the block itself (engines/self_route.cuh)
//   s_list  [R]  i32  (shared, out) the expert's routes, in route order
#pragma once

#include "core/types.cuh"
#include "engines/mma_stage.cuh"

namespace qmoe {

// The routes of one expert. Every block loads the R ids into shared memory; the block of route r
// proceeds only if no earlier route has the same expert, and then lists (in route order) every
// route of that expert.
struct ExpertRoutes {
  i32 n;  // routes listed (0: this block is a duplicate and has nothing to do)
};

// The thread's first route id (collect_routes' PRE), read before the block's weight copies go out, so the scan's L2
// round trip runs under them rather than behind them.
__device__ __forceinline__ i32 load_route_id(const i32* __restrict__ ids, i32 R) {
  return (i32)threadIdx.x < R ? __ldcg(ids + threadIdx.x) : 0;
}

// PRE: the first kMmaThreads ids come from each thread's `pre` (load_route_id). filled: s_ids already holds them
// (self_route, which ended with a barrier; block-uniform).
template <bool PRE = false>
__device__ __forceinline__ ExpertRoutes collect_routes(const i32* __restrict__ ids, i32 R, i32* s_ids, i32* s_list,
                                                       i32* s_n, i32 pre = 0, bool filled = false) {
  const i32 r = blockIdx.y;
  if (!filled) {
    for (i32 q = threadIdx.x; q < R; q += kMmaThreads)
      s_ids[q] = PRE && q < kMmaThreads ? pre : __ldcg(ids + q);  // L2: FC2 may read before its wait
    __syncthreads();
  }
  const i32 e = s_ids[r];
  bool dup = false;
  for (i32 q = threadIdx.x; q < r; q += kMmaThreads) dup |= s_ids[q] == e;
  if (__syncthreads_or(dup)) return ExpertRoutes{0};
  if (threadIdx.x < 32) {
    const u32 lane = threadIdx.x;
    i32 n = 0;
    for (i32 base = r; base < R; base += 32) {
      const i32 q = base + (i32)lane;
      const bool hit = q < R && s_ids[q] == e;
      const u32 m = __ballot_sync(0xffffffffu, hit);
      if (hit) s_list[n + __popc(m & ((1u << lane) - 1u))] = q;
      n += __popc(m);
    }
    if (lane == 0) *s_n = n;
  }
  __syncthreads();
  return ExpertRoutes{*s_n};
}

}  // namespace qmoe
