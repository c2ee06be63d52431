// routing/route_grouped.cuh: grouped sigmoid top-k routing [ext] (DeepSeek-V3 / Kimi-K2 / GLM-4.5 style;
// docs/contract.md, "Grouped sigmoid routing"), one 128-thread block per token row, then the shared experts
// [ext] as the row's last S slots exactly as routing/route.cuh writes them.
//
//   logits              [rows, E]      LT (float or T)  -- the router logits (or the router GEMM's, f32)
//   router_weights      [rows, E]      WT, optional     -- mixing weights gathered at the chosen experts
//   router_score_bias   [E]            f32, optional    -- added to the scores experts are chosen by only
//   x                   [rows, H]      T, GATE only     -- the layer input
//   shared_gate_weight  [H]            f32, GATE only   -- shared weight = sigmoid(x[row] · g)
//   expert_map          [E]            i32, optional    -- expert slices [ext]: local index, -1 where not held
//   topk_ids            [rows, k + S]  i32 (out)        -- route r = row*(k + S) + slot
//   topk_w              [rows, k + S]  f32 (out)
//   expert_counts       [E]            i64, COUNT only  -- expert statistics [ext] (route.cuh's count_route)
//
// Per row, in float32: score s_e = 1 / (1 + e^-l_e), choice c_e = s_e + bias_e. With n_group G >= 2 the
// E experts form G groups of E/G consecutive ones; a group's value is the sum of its two largest choices
// (its one choice where E/G = 1) and the groups_kept groups of largest value stay (order: route.cuh's total
// order on the float32 bits, +NaN above +inf, equal values to the lower group). The k experts of largest
// choice among the kept groups land in slots 0..k-1 by rank (the same composite keys and bitonic sort as
// route.cuh; experts of dropped groups get key 0, below every real one, and k <= the kept experts, which
// the host checks). Weight: s_e (not c_e), or router_weights[e]; normalised over the k picks in slot order
// when `normalize` (w / sum, 0 where the sum is 0), then times routed_scaling. E <= kRouteMaxExperts,
// k <= kRouteMaxK, G <= kRouteThreads.
#pragma once

#include "core/pdl.cuh"
#include "core/reduce.cuh"
#include "core/types.cuh"
#include "routing/bitonic.cuh"
#include "routing/route.cuh"

namespace qmoe {

// The larger of two composites (order key << 32 | 0xFFFF - index; 0: none).
__device__ __forceinline__ u64 comp_max(u64 a, u64 b) { return a > b ? a : b; }

// The value a composite's order key stands for (order_key inverted).
__device__ __forceinline__ float comp_value(u64 c) {
  const u32 key = (u32)(c >> 32);
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The top two composites (t1 >= t2) of `choice[first .. first + n)` over one warp: lanes keep their own
// best two, then a butterfly merges pairs (the merged second is the larger of the two seconds and the
// smaller first). Every lane gets the result.
__device__ __forceinline__ void warp_top2(const float* choice, i32 first, i32 n, u64& t1, u64& t2) {
  const int lane = threadIdx.x & 31;
  t1 = 0ull;
  t2 = 0ull;
  for (i32 i = lane; i < n; i += 32) {
    const i32 e = first + i;
    const u64 c = ((u64)order_key(choice[e]) << 32) | (u64)(0xFFFFu - (u32)e);
    if (c > t1) {
      t2 = t1;
      t1 = c;
    } else if (c > t2) {
      t2 = c;
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const u64 o1 = __shfl_xor_sync(0xffffffffu, t1, m), o2 = __shfl_xor_sync(0xffffffffu, t2, m);
    const u64 lo = t1 > o1 ? o1 : t1;
    t1 = comp_max(t1, o1);
    t2 = comp_max(lo, comp_max(t2, o2));
  }
}

// LT: logits, WT: router_weights, T: x (the activation dtype); GATE: shared slots get the sigmoid gate; COUNT: expert
// statistics [ext] (count_route).
template <typename LT, typename WT, typename T, bool HAS_RW, bool GATE, bool COUNT>
__global__ void __launch_bounds__(kRouteThreads)
route_grouped(const LT* __restrict__ logits, const WT* __restrict__ router_weights, i32 rows, i32 E_logits,
              i32 k_routed, i32 S, i32 H, i32 normalize, const T* __restrict__ x,
              const float* __restrict__ shared_gate_weight, i32 E_routed, const i32* __restrict__ expert_map,
              const float* __restrict__ router_score_bias, i32 n_group, i32 groups_kept, float routed_scaling,
              i32* __restrict__ topk_ids, float* __restrict__ topk_w, i64* __restrict__ expert_counts) {
  __shared__ u64 comp[kRouteMaxExperts];  // the sort's exchange buffer
  __shared__ float score[kRouteMaxExperts];   // s_e, the unbiased sigmoid scores
  __shared__ float choice[kRouteMaxExperts];  // c_e = s_e + bias_e
  __shared__ u32 group_key[kRouteThreads];    // order_key of each group's value
  __shared__ u8 kept[kRouteThreads];          // whether each group stays
  __shared__ float red[kRouteThreads / 32];
  __shared__ i32 sel_id[kRouteMaxK];
  __shared__ float sel_w[kRouteMaxK];
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x, warp = tid >> 5;
  const i64 out0 = row * (k_routed + S);  // the row's first route
  const LT* l = logits + row * E_logits;

  route_row_start<T, GATE>(GATE ? x + row * H : x, shared_gate_weight, H, red, out0, k_routed, S, E_routed, topk_ids,
                           topk_w);

  for (i32 e = tid; e < E_logits; e += kRouteThreads) {
    const float s = 1.0f / (1.0f + expf(-Traits<LT>::to_float(l[e])));
    score[e] = s;
    choice[e] = router_score_bias ? s + router_score_bias[e] : s;
  }
  const i32 G = n_group > 1 ? n_group : 1, per_group = E_logits / G;
  __syncthreads();  // choices visible
  if (G > 1) {
    for (i32 g = warp; g < G; g += kRouteThreads / 32) {  // a warp per group: its two best choices
      u64 t1, t2;
      warp_top2(choice, g * per_group, per_group, t1, t2);
      if ((tid & 31) == 0) group_key[g] = order_key(per_group > 1 ? comp_value(t1) + comp_value(t2) : comp_value(t1));
    }
    __syncthreads();
    if (tid < G) {  // group tid's rank: the groups ordered before it (larger key, or equal and lower)
      const u32 mine = group_key[tid];
      i32 rank = 0;
      for (i32 g = 0; g < G; ++g) rank += group_key[g] > mine || (group_key[g] == mine && g < tid);
      kept[tid] = rank < groups_kept;
    }
    __syncthreads();
  }

  u64 c[kRoutePerThread];  // composite of expert tid + kRouteThreads·j (0: padding or a dropped group)
#pragma unroll
  for (int j = 0; j < kRoutePerThread; ++j) {
    const i32 e = tid + kRouteThreads * j;
    const bool in = e < E_logits && (G == 1 || kept[e / per_group]);
    c[j] = in ? ((u64)order_key(choice[e]) << 32) | (u64)(0xFFFFu - (u32)e) : 0ull;
  }
  const i32 P = E_logits <= 1 ? 1 : 1 << (32 - __clz(E_logits - 1));  // E_logits rounded up to a power of two
  bitonic_sort_desc<kRouteThreads>(c, P, comp);
  if (tid < k_routed) {  // position tid of the sorted order is thread tid's c[0] (k <= kRouteMaxK < kRouteThreads)
    const i32 e = (i32)(0xFFFFu - (u32)(c[0] & 0xFFFFFFFFull));
    sel_id[tid] = e;
    if constexpr (HAS_RW) sel_w[tid] = Traits<WT>::to_float(router_weights[row * E_logits + e]);
    else sel_w[tid] = score[e];
  }
  __syncthreads();
  if (tid < k_routed)
    write_routed_slot<COUNT>(tid, sel_id, sel_w, k_routed, normalize, routed_scaling, out0, expert_map, topk_ids, topk_w,
                             expert_counts);
}

}  // namespace qmoe
