// routing/route_group.cuh: a call's routing and its grouping by expert in one block, the grouped engines' first
// launch for calls of few routes (kernels/route.py routes_in_group: softmax routing a warp a row, at most
// kLeadMaxRoutes routes, no router GEMM, router weights or expert statistics). It replaces two launches, the routing
// kernel's and group_by_expert's, by one; the wgmma engine's form (engines/wgmma_prefill.cuh, wg_route_group) also
// does wg_prepare's work, a third.
//
//   logits          [rows, E]      LT             router logits
//   expert_map      [E]            i32, optional  expert slices [ext]: local index, -1 where not held
//   topk_ids        [R]            i32 (out)      R = rows·(k + S), route r = row·(k + S) + slot
//   topk_w          [R]            f32 (out)
//   offsets, tile_offsets, sorted  (out)          routing/group.cuh's
//
// Warp w of the block routes rows w, w + kGroupWarps, ... exactly as route_topk_warp does (route_row_warp), keeping
// the ids in shared memory as well; after a block barrier the block groups them (group_routes). The outputs are
// those of the two launches it replaces, bit for bit.
#pragma once

#include "core/pdl.cuh"
#include "core/types.cuh"
#include "routing/group.cuh"
#include "routing/route_warp.cuh"

namespace qmoe {

inline constexpr int kLeadMaxRoutes = 2048;  // the ids' copy in shared memory: 8 KB (kernels/route.py LEAD_MAX_ROUTES)

// Block 0's work: every row routed, then grouped. Call with the whole block; R <= kLeadMaxRoutes (the host's).
template <typename LT>
__device__ __forceinline__ void route_and_group(const LT* __restrict__ logits, i32 rows, i32 E_logits, i32 k_routed, i32 S,
                                                i32 normalize, i32 E_routed, const i32* __restrict__ expert_map,
                                                i32* __restrict__ topk_ids, float* __restrict__ topk_w, i32 R, i32 E, i32 BR,
                                                i32* __restrict__ offsets, i32* __restrict__ tile_offsets,
                                                i32* __restrict__ sorted) {
  __shared__ i32 ids_s[kLeadMaxRoutes];  // [R] the routes' experts, as topk_ids
  for (i64 row = threadIdx.x >> 5; row < rows; row += kGroupWarps)
    route_row_warp<LT, LT, false, false>(row, logits, nullptr, E_logits, k_routed, S, normalize, E_routed, expert_map, topk_ids,
                                         topk_w, nullptr, ids_s);
  __syncthreads();  // every row's ids in ids_s
  group_routes(ids_s, R, E, BR, offsets, tile_offsets, sorted);
}

// One block of kGroupThreads threads. The forward's first launch (never overlapped: the host leaves the router GEMM's
// layers to the two launches); it releases the next kernel's blocks at once (they wait for this grid).
template <typename LT>
__global__ void __launch_bounds__(kGroupThreads)
route_group(const LT* __restrict__ logits, i32 rows, i32 E_logits, i32 k_routed, i32 S, i32 normalize, i32 E_routed,
            const i32* __restrict__ expert_map, i32* __restrict__ topk_ids, float* __restrict__ topk_w, i32 R, i32 E, i32 BR,
            i32* __restrict__ offsets, i32* __restrict__ tile_offsets, i32* __restrict__ sorted) {
  pdl_wait();
  pdl_release();
  route_and_group<LT>(logits, rows, E_logits, k_routed, S, normalize, E_routed, expert_map, topk_ids, topk_w, R, E, BR,
                      offsets, tile_offsets, sorted);
}

}  // namespace qmoe
