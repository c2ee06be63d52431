// engines/self_route.cuh: a decode block's own routing. At calls of at most a block's warps of rows
// (kernels/route.py routes_in_decode: softmax routing a warp a row, no router GEMM, router weights or expert
// statistics), the decode kernels' blocks route the call themselves, from the logits, instead of waiting for the
// routing kernel's ids: the forward loses that launch and the L2 round trips between it and FC1, which at one token
// are a fifth of a small layer's time (the stamped timelines in docs/performance-log.md).
//
//   sr.logits  [rows, E_logits]  f32 or T   the call's router logits (an input: read before any wait)
//   s_ids      [R]               i32        (out, shared) the route ids, as topk_ids
//   s_w        [R]               f32        (out, shared, nullable) the routing weights, as topk_w
//
// Warp w routes row w exactly as the routing kernel does (routing/route_warp.cuh route_logits_warp), so every block of
// FC1 and FC2 holds the same ids bit for bit, and the weights are the routing kernel's. R <= kSelfRouteMaxRoutes
// (FC2's s_w) and rows <= the block's warps, which the host guarantees and this checks (trap, never half-routed).
#pragma once

#include "core/args.cuh"
#include "core/types.cuh"
#include "routing/route_warp.cuh"

namespace qmoe {

// The routes a self-routed call has at most (FC2's s_w), the host's (kernels/route.py SELF_ROUTE_MAX_ROUTES, in the
// generated unit: kernels/mma_decode.py decisions).
#ifndef QMOE_SELF_ROUTE_MAX_ROUTES
#error "QMOE_SELF_ROUTE_MAX_ROUTES comes from the host (kernels/mma_decode.py decisions)"
#endif
inline constexpr int kSelfRouteMaxRoutes = QMOE_SELF_ROUTE_MAX_ROUTES;

// Route the call into s_ids (and s_w) when sr.route, then a block barrier; false (nothing done) when off. Call with the
// whole block (block-uniform).
template <typename T>
__device__ __forceinline__ bool self_route(const SelfRoute& sr, i32 R, i32 E_routed, i32* s_ids, float* s_w) {
  if (!sr.route) return false;
  const i32 per_row = sr.k_routed + sr.S;
  const i32 rows = R / per_row;
  if (R > kSelfRouteMaxRoutes || rows * per_row != R || rows > (i32)(blockDim.x >> 5)) __trap();
  const i32 row = threadIdx.x >> 5;
  if (row < rows) {
    const float* lf = static_cast<const float*>(sr.logits) + (i64)row * sr.E_logits;
    const T* lt = static_cast<const T*>(sr.logits) + (i64)row * sr.E_logits;
    auto logit = [&](i32 e) { return sr.logits_f32 ? lf[e] : Traits<T>::to_float(lt[e]); };
    route_logits_warp<float, false, false, false>(row, logit, nullptr, sr.E_logits, sr.k_routed, sr.S, sr.normalize,
                                                  E_routed, sr.expert_map, nullptr, nullptr, nullptr, s_ids, s_w);
  }
  __syncthreads();
  return true;
}

}  // namespace qmoe
