// routing/route_warp.cuh: softmax top-k routing with one warp per token row, for layers of at most
// kRouteWarpMaxExperts experts without the sparse mixer or a shared-expert gate (routing/route.cuh
// holds the contract, the block-per-row kernel for every other layer, and order_key).
//
//   logits          [rows, E]      LT             router logits
//   router_weights  [rows, E]      WT, optional   mixing weights gathered at the chosen experts
//   expert_map      [E]            i32, optional  expert slices [ext]: local index, -1 where not held
//   topk_ids        [rows, k + S]  i32 (out)      route r = row*(k + S) + slot
//   topk_w          [rows, k + S]  f32 (out)
//   expert_counts   [E]            i64, COUNT only  expert statistics [ext] (route.cuh's count_route)
//
// The picks are route.cuh's: expert e's composite (order_key(l_e) << 32) | (0xFFFF - e), the k largest in
// descending order land in slots 0..k-1 (equal keys: the lower index first). Here they come from k rounds of a warp
// max over the composites (lane l holds experts l, l + 32, ...; the winner's is cleared), not from a block-wide
// sort: no shared memory and no barrier (the block kernel took 30.6 µs for 4096 rows of 128 experts; a qwen3 layer
// call at 4096 tokens is 18 µs shorter with this one). Softmax in float32: the row max, then sum of exp(l - max) as
// lane sums in expert order and a fixed butterfly over lanes; the normalising sum over the k picks in slot order
// (deterministic; the last bits may differ from the block kernel's, whose sum tree differs).
// Shared experts [ext] without a gate: slot k + s has id E_routed + s and weight 1.
#pragma once

#include "core/pdl.cuh"
#include "core/reduce.cuh"
#include "core/types.cuh"
#include "routing/route.cuh"

namespace qmoe {

inline constexpr int kRouteWarpRows = 4;  // rows (warps) per block
inline constexpr int kRouteWarpPerLane = 8;
inline constexpr int kRouteWarpMaxExperts = 32 * kRouteWarpPerLane;

// The logit whose order_key is `key` (order_key inverted).
__device__ __forceinline__ float key_value(u32 key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The warp's largest composite (order_key << 32 | 0xFFFF - e; 0: none): two redux.sync max (sm_80+) over its
// halves, the key then the index among the lanes that hold that key -- the 64-bit max in two instructions instead of
// five rounds of two shuffles each. The same picks bit for bit; the k rounds are on the decode forward's critical path
// (FC1 waits for these ids): 0.4-1.1 us off a 1-2 token forward on the H200 (qwen3-30b-a3b 1 token 26.5 -> 25.6 us;
// docs/performance-log.md).
__device__ __forceinline__ u64 warp_max_composite(u64 v) {
  const u32 key = __reduce_max_sync(0xffffffffu, (u32)(v >> 32));
  const u32 low = __reduce_max_sync(0xffffffffu, (u32)(v >> 32) == key ? (u32)v : 0u);
  return ((u64)key << 32) | low;
}

// Row `row`'s routes, by the calling warp, from the logits `logit(e)` gives (the routing kernel's below: from memory;
// routing/route_group.cuh routes a call's rows this way inside the grouping's block, engines/self_route.cuh inside a
// decode block, whose logits may be float32 or T). ids_s / w_s: nullptr, or shared memory [R] that gets the row's ids /
// weights too, at the same places. OUT false: topk_ids / topk_w are not written (the decode blocks that route
// themselves keep the routes in shared memory only).
template <typename WT, bool HAS_RW, bool COUNT, bool OUT, typename Logit>
__device__ __forceinline__ void route_logits_warp(i64 row, Logit logit, const WT* __restrict__ router_weights,
                                                  i32 E_logits, i32 k_routed, i32 S, i32 normalize, i32 E_routed,
                                                  const i32* __restrict__ expert_map, i32* __restrict__ topk_ids,
                                                  float* __restrict__ topk_w, i64* __restrict__ expert_counts,
                                                  i32* ids_s, float* w_s) {
  const i32 lane = threadIdx.x & 31;
  const i64 out0 = row * (k_routed + S);
  u64 c[kRouteWarpPerLane];  // composite of expert lane + 32·j (0: padding, below every real one)
  float v[kRouteWarpPerLane];
  float m = __int_as_float(0xff800000);  // -inf
#pragma unroll
  for (int j = 0; j < kRouteWarpPerLane; ++j) {
    const i32 e = lane + 32 * j;
    const bool real = e < E_logits;
    v[j] = real ? logit(e) : __int_as_float(0xff800000);
    c[j] = real ? ((u64)order_key(v[j]) << 32) | (u64)(0xFFFFu - (u32)e) : 0ull;
    if (real) m = fmaxf(m, v[j]);
  }
  m = warp_max(m);
  float denom = 0.0f;
  if constexpr (!HAS_RW) {
#pragma unroll
    for (int j = 0; j < kRouteWarpPerLane; ++j)
      if (lane + 32 * j < E_logits) denom += expf(v[j] - m);
    denom = warp_sum(denom);
  }

  // slot t: the largest composite left; lane t keeps its expert and weight
  i32 my_id = 0;
  float my_w = 0.0f;
  for (i32 t = 0; t < k_routed; ++t) {
    u64 best = 0;
#pragma unroll
    for (int j = 0; j < kRouteWarpPerLane; ++j) best = c[j] > best ? c[j] : best;
    best = warp_max_composite(best);
#pragma unroll
    for (int j = 0; j < kRouteWarpPerLane; ++j)
      if (c[j] == best) c[j] = 0;  // composites are unique: only the winner's matches
    if (lane == t) {
      my_id = (i32)(0xFFFFu - (u32)(best & 0xFFFFFFFFull));
      if constexpr (HAS_RW) my_w = Traits<WT>::to_float(router_weights[row * E_logits + my_id]);
      else my_w = expf(key_value((u32)(best >> 32)) - m) / denom;
    }
  }
  float s = 0.0f;
  if (normalize) {  // slot order, every lane
    if constexpr (OUT) {
      for (i32 t = 0; t < k_routed; ++t) s += __shfl_sync(0xffffffffu, my_w, t);
    } else {  // a decode block's own routing: not unrolled, as its code is in every decode kernel (8 KB less)
#pragma unroll 1
      for (i32 t = 0; t < k_routed; ++t) s += __shfl_sync(0xffffffffu, my_w, t);
    }
  }
  if (lane < k_routed) {
    const i32 id = expert_map ? expert_map[my_id] : my_id;
    if constexpr (OUT) topk_ids[out0 + lane] = id;
    if (ids_s) ids_s[out0 + lane] = id;
    const float w = normalize ? (s != 0.0f ? my_w / s : 0.0f) : my_w;
    if constexpr (OUT) topk_w[out0 + lane] = w;
    if (w_s) w_s[out0 + lane] = w;
    count_route<COUNT>(expert_counts, my_id);
  }
  for (i32 sl = lane; sl < S; sl += 32) {  // shared experts: the row's last S slots
    if constexpr (OUT) topk_ids[out0 + k_routed + sl] = E_routed + sl;
    if (ids_s) ids_s[out0 + k_routed + sl] = E_routed + sl;
    if constexpr (OUT) topk_w[out0 + k_routed + sl] = 1.0f;
    if (w_s) w_s[out0 + k_routed + sl] = 1.0f;
  }
}

// Row `row`'s routes from the logits in memory (route_logits_warp's outputs).
template <typename LT, typename WT, bool HAS_RW, bool COUNT>
__device__ __forceinline__ void route_row_warp(i64 row, const LT* __restrict__ logits, const WT* __restrict__ router_weights,
                                               i32 E_logits, i32 k_routed, i32 S, i32 normalize, i32 E_routed,
                                               const i32* __restrict__ expert_map, i32* __restrict__ topk_ids,
                                               float* __restrict__ topk_w, i64* __restrict__ expert_counts, i32* ids_s) {
  const LT* l = logits + row * E_logits;
  route_logits_warp<WT, HAS_RW, COUNT, true>(row, [&](i32 e) { return Traits<LT>::to_float(l[e]); }, router_weights,
                                             E_logits, k_routed, S, normalize, E_routed, expert_map, topk_ids, topk_w,
                                             expert_counts, ids_s, nullptr);
}

template <typename LT, typename WT, bool HAS_RW, bool COUNT>
__global__ void __launch_bounds__(32 * kRouteWarpRows)
route_topk_warp(const LT* __restrict__ logits, const WT* __restrict__ router_weights, i32 rows, i32 E_logits,
                i32 k_routed, i32 S, i32 normalize, i32 E_routed, const i32* __restrict__ expert_map,
                i32* __restrict__ topk_ids, float* __restrict__ topk_w, i64* __restrict__ expert_counts) {
  const i64 row = (i64)blockIdx.x * kRouteWarpRows + (threadIdx.x >> 5);
  pdl_wait();     // the logits may come from the router GEMM launched just before
  pdl_release();  // the expert kernels' blocks may start (they wait for these ids)
  if (row >= rows) return;
  route_row_warp<LT, WT, HAS_RW, COUNT>(row, logits, router_weights, E_logits, k_routed, S, normalize, E_routed, expert_map,
                                        topk_ids, topk_w, expert_counts, nullptr);
}

}  // namespace qmoe
