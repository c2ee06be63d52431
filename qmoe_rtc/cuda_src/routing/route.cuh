// routing/route.cuh: softmax top-k routing, one 128-thread block per token row (docs/contract.md, "Routing"),
// then the shared experts [ext] as the row's last S slots ("Shared experts"). Layers of at most 256
// experts without the sparse mixer or a shared-expert gate take routing/route_warp.cuh (a warp per row).
//
//   logits              [rows, E]  LT (float or T)   -- router_probs are logits (or the router GEMM's, f32)
//   router_weights      [rows, E]  WT, optional      -- mixing weights gathered at the chosen experts
//   x                   [rows, H]  T, GATE only      -- the layer input
//   shared_gate_weight  [H]        f32, GATE only    -- shared weight = sigmoid(x[row] · g)
//   expert_map          [E]        i32, optional     -- expert slices [ext]: local index of each expert, -1
//                                                       where this layer does not hold it
//   topk_ids            [rows, k + S]  i32 (out)     -- route r = row*(k + S) + slot
//   topk_w              [rows, k + S]  f32 (out)
//   expert_counts       [E]        i64, COUNT only   -- expert statistics [ext]: += the routes each expert got
//
// E and k are the routed experts and top-k. Slots 0..k-1: the routed picks. Selection by rank: expert
// e's rank is the number of experts ordered before it (a larger total-order key on the float32 bits,
// -0 < +0 and +NaN above +inf; equal keys: the lower index first), and experts with rank < k land in
// slot = rank. The ranks come from one bitonic sort of (key, index) composites held in registers
// (routing/bitonic.cuh: warp shuffles below stride 32, so 3 barrier steps at E = 128; the all-pairs
// count it replaced cost O(E²) per row on one SM: 36 µs at E = 512 under ncu). Softmax and sums in
// float32; sums over the k picks are taken in slot order (deterministic). E <= kRouteMaxExperts,
// k <= kRouteMaxK.
// Expert slices [ext]: the picks and weights are the whole layer's; an id is written through
// expert_map (-1: not held here; the engines skip such routes). E_routed: the experts this layer holds
// (E without a slice), after which the shared experts' ids start.
// Slots k..k+S-1: shared expert s has id E_routed + s and weight 1, or with GATE sigmoid(d) = 1/(1 + e^-d),
// d = x[row] · g in float32: thread t sums the 8-element chunks t, t + 128, ... in order, then the fixed
// block reduction (the same sum whatever the alignment: vector and scalar loads feed the same FMAs).
// Expert statistics [ext] (COUNT): one atomic add per routed pick to expert_counts[e], e the whole layer's index
// (before expert_map); shared slots are not counted. The modules without COUNT never read the pointer.
#pragma once

#include "core/pdl.cuh"
#include "core/reduce.cuh"
#include "core/types.cuh"
#include "routing/bitonic.cuh"

namespace qmoe {

inline constexpr int kRouteThreads = 128;
inline constexpr int kRouteMaxExperts = 512;
inline constexpr int kRoutePerThread = kRouteMaxExperts / kRouteThreads;
inline constexpr int kRouteMaxK = 32;

// Expert statistics [ext]: one more route to expert e (the layer's index), where the kernel counts.
template <bool COUNT>
__device__ __forceinline__ void count_route(i64* counts, i32 e) {
  if constexpr (COUNT) atomicAdd(reinterpret_cast<unsigned long long*>(counts) + e, 1ull);
}

__device__ __forceinline__ u32 order_key(float v) {
  const u32 u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// sigmoid(x[row] · g) over H in float32 (every thread gets it). Contains __syncthreads().
template <typename T>
__device__ __forceinline__ float shared_gate(const T* __restrict__ xr, const float* __restrict__ g, i32 H, float* red) {
  const bool vec = (H & 7) == 0 && is_aligned(xr, 16) && is_aligned(g, 16);
  float d = 0.0f;
  for (i32 c = threadIdx.x * 8; c < H; c += kRouteThreads * 8) {
    float xv[8], gv[8];
    if (vec) {
      load8_f32<T, true>(xr + c, xv);
      load8_f32<float, true>(g + c, gv);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        xv[i] = c + i < H ? Traits<T>::to_float(xr[c + i]) : 0.0f;
        gv[i] = c + i < H ? g[c + i] : 0.0f;
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) d = fmaf(xv[i], gv[i], d);
  }
  d = block_sum<kRouteThreads>(d, red);
  return 1.0f / (1.0f + expf(-d));
}

// A block-per-row routing kernel's start: the shared-expert gate (GATE: from the input, before the wait), the wait for
// the logits, the release of the expert kernels, and the row's S shared slots (ids E_routed + s, weight the gate or 1)
// after its k routed ones, out0 = the row's first route. Contains __syncthreads() where GATE.
template <typename T, bool GATE>
__device__ __forceinline__ void route_row_start(const T* __restrict__ xr, const float* __restrict__ shared_gate_weight,
                                                i32 H, float* red, i64 out0, i32 k_routed, i32 S, i32 E_routed,
                                                i32* __restrict__ topk_ids, float* __restrict__ topk_w) {
  float gate = 1.0f;
  if constexpr (GATE) gate = shared_gate<T>(xr, shared_gate_weight, H, red);  // the input: no wait
  pdl_wait();     // the logits may come from the router GEMM launched just before
  pdl_release();  // the expert kernels' blocks may start (they wait for these ids)
  for (i32 s = threadIdx.x; s < S; s += kRouteThreads) {  // shared experts: the row's last S slots
    topk_ids[out0 + k_routed + s] = E_routed + s;
    topk_w[out0 + k_routed + s] = gate;
  }
}

// Routed slot `slot` (< k_routed) of a block-per-row kernel, once sel_id / sel_w [k_routed] are visible: the weight,
// normalised over the k picks in slot order (0 where their sum is 0) when `normalize`, times `scale`; the id through
// expert_map; the pick counted (COUNT).
template <bool COUNT>
__device__ __forceinline__ void write_routed_slot(i32 slot, const i32* sel_id, const float* sel_w, i32 k_routed,
                                                  i32 normalize, float scale, i64 out0, const i32* __restrict__ expert_map,
                                                  i32* __restrict__ topk_ids, float* __restrict__ topk_w,
                                                  i64* __restrict__ expert_counts) {
  float w = sel_w[slot];
  if (normalize) {
    float s = 0.0f;
    for (i32 t = 0; t < k_routed; ++t) s += sel_w[t];  // slot order: the same sum in every thread
    w = s != 0.0f ? w / s : 0.0f;
  }
  topk_ids[out0 + slot] = expert_map ? expert_map[sel_id[slot]] : sel_id[slot];
  topk_w[out0 + slot] = w * scale;
  count_route<COUNT>(expert_counts, sel_id[slot]);
}

// LT: logits, WT: router_weights, T: x (the activation dtype); GATE: shared slots get the sigmoid gate; COUNT: expert
// statistics [ext] (count_route).
template <typename LT, typename WT, typename T, bool HAS_RW, bool SPARSE, bool GATE, bool COUNT>
__global__ void __launch_bounds__(kRouteThreads)
route_topk(const LT* __restrict__ logits, const WT* __restrict__ router_weights, i32 rows, i32 E_logits,
           i32 k_routed, i32 S, i32 H, i32 normalize, const T* __restrict__ x, const float* __restrict__ shared_gate_weight, i32 E_routed,
           const i32* __restrict__ expert_map, i32* __restrict__ topk_ids, float* __restrict__ topk_w,
           i64* __restrict__ expert_counts) {
  // (order key << 32) | (0xFFFF - e): a larger composite is ordered first (equal keys: lower index)
  __shared__ u64 comp[kRouteMaxExperts];  // the sort's exchange buffer
  __shared__ float vals[kRouteMaxExperts];
  __shared__ float red[kRouteThreads / 32];
  __shared__ i32 sel_id[kRouteMaxK];
  __shared__ float sel_w[kRouteMaxK];
  const i64 row = blockIdx.x;
  const int tid = threadIdx.x;
  const i64 out0 = row * (k_routed + S);  // the row's first route
  const LT* l = logits + row * E_logits;

  route_row_start<T, GATE>(GATE ? x + row * H : x, shared_gate_weight, H, red, out0, k_routed, S, E_routed, topk_ids,
                           topk_w);

  float v[kRoutePerThread];
  u64 c[kRoutePerThread];  // composite of expert tid + kRouteThreads·j (0: padding, below every real one)
  float m = __int_as_float(0xff800000);  // -inf
#pragma unroll
  for (int j = 0; j < kRoutePerThread; ++j) {
    const i32 e = tid + kRouteThreads * j;
    v[j] = e < E_logits ? Traits<LT>::to_float(l[e]) : __int_as_float(0xff800000);
    c[j] = e < E_logits ? ((u64)order_key(v[j]) << 32) | (u64)(0xFFFFu - (u32)e) : 0ull;
    if (e < E_logits) {
      vals[e] = v[j];
      m = fmaxf(m, v[j]);
    }
  }
  m = block_max<kRouteThreads>(m, red);  // contains __syncthreads: vals are visible after it

  // order: a bitonic sort (descending) of the composite keys; position = rank, the first k_routed are
  // the picks (position p is thread p's c[0] after the sort, as p < k_routed <= kRouteMaxK < kRouteThreads)
  const i32 P = E_logits <= 1 ? 1 : 1 << (32 - __clz(E_logits - 1));  // E_logits rounded up to a power of two
  bitonic_sort_desc<kRouteThreads>(c, P, comp);
  if (tid < k_routed) sel_id[tid] = (i32)(0xFFFFu - (u32)(c[0] & 0xFFFFFFFFull));
  __syncthreads();  // sel_id visible to every thread

  if constexpr (SPARSE) {
    // Phi-3.5-MoE sparse mixer, k = 2, jitter eps = 0.01: w_t = 1 / sum over the experts j not masked
    // at pick t of exp(l_j - m_t), masked: (m_t - l_j) > 2 eps max(|l_j|, m_t) (pick 2 also masks e1)
    __syncthreads();
    const i32 e1 = sel_id[0], e2 = sel_id[1];
    const float m1 = vals[e1], m2 = vals[e2];
    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int j = 0; j < kRoutePerThread; ++j) {
      const i32 e = tid + kRouteThreads * j;
      if (e >= E_logits) continue;
      if (!((m1 - v[j]) > 0.02f * fmaxf(fabsf(v[j]), m1))) s1 += expf(v[j] - m1);
      if (e != e1 && !((m2 - v[j]) > 0.02f * fmaxf(fabsf(v[j]), m2))) s2 += expf(v[j] - m2);
    }
    s1 = block_sum<kRouteThreads>(s1, red);
    s2 = block_sum<kRouteThreads>(s2, red);
    if (tid == 0) {
      topk_ids[out0] = expert_map ? expert_map[e1] : e1;
      topk_ids[out0 + 1] = expert_map ? expert_map[e2] : e2;
      topk_w[out0] = 1.0f / s1;
      topk_w[out0 + 1] = 1.0f / s2;
      count_route<COUNT>(expert_counts, e1);
      count_route<COUNT>(expert_counts, e2);
    }
  } else {
    float denom = 0.0f;
    if constexpr (!HAS_RW) {
#pragma unroll
      for (int j = 0; j < kRoutePerThread; ++j)
        if (tid + kRouteThreads * j < E_logits) denom += expf(v[j] - m);
      denom = block_sum<kRouteThreads>(denom, red);  // also orders the sel_id writes before the reads
    } else {
      __syncthreads();
    }
    if (tid < k_routed) {
      const i32 e = sel_id[tid];
      float w;
      if constexpr (HAS_RW) w = Traits<WT>::to_float(router_weights[row * E_logits + e]);
      else w = expf(vals[e] - m) / denom;
      sel_w[tid] = w;
    }
    __syncthreads();
    if (tid < k_routed)  // the softmax weights are not scaled (a scaling factor is refused with softmax scores)
      write_routed_slot<COUNT>(tid, sel_id, sel_w, k_routed, normalize, 1.0f, out0, expert_map, topk_ids, topk_w,
                               expert_counts);
  }
}

}  // namespace qmoe
