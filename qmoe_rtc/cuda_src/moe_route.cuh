// moe_route.cuh: softmax top-k routing, one warp per token row (CONTRACT.md "Routing").
//
//   logits          [rows, E]  LT (float or T)       -- router_probs are logits
//   router_weights  [rows, E]  WT, optional          -- mixing weights gathered at the chosen experts
//   topk_ids        [rows, k]  i32   (out)           -- route r = row*k + slot
//   topk_w          [rows, k]  f32   (out)
//
// Top-k compares a total-order key on the float32 bits (-0 < +0, +NaN above +inf), ties to the
// lower expert index. Softmax in float32. E <= 32 * kMaxPerLane.
#pragma once

#include "reduce.cuh"
#include "types.cuh"

namespace qmoe {

constexpr int kRouteMaxPerLane = 16;  // E <= 512

__device__ __forceinline__ u32 order_key(float v) {
  const u32 u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Warp arg-max over (key, idx): largest key, ties to the lower index. All lanes get the result.
__device__ __forceinline__ void warp_argmax_key(u32& key, i32& idx) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u32 ok = __shfl_xor_sync(kFullMask, key, o);
    const i32 oi = __shfl_xor_sync(kFullMask, idx, o);
    if (ok > key || (ok == key && oi < idx)) {
      key = ok;
      idx = oi;
    }
  }
}

// Best remaining (key, idx) of this lane's entries e = lane + 32*j not yet taken.
__device__ __forceinline__ void lane_best(const u32 (&keys)[kRouteMaxPerLane], u32 taken, i32 E, int epl, int lane,
                                          u32& key, i32& idx) {
  key = 0u;
  idx = 0x7fffffff;
#pragma unroll
  for (int j = 0; j < kRouteMaxPerLane; ++j) {
    if (j >= epl) break;
    const i32 e = lane + 32 * j;
    if (e < E && !((taken >> j) & 1u) && (keys[j] > key || idx == 0x7fffffff)) {
      key = keys[j];
      idx = e;
    }
  }
}

template <typename LT, typename WT, bool HAS_RW, bool SPARSE>
__global__ void route_topk(const LT* __restrict__ logits, const WT* __restrict__ router_weights, i32 rows, i32 E,
                           i32 k, i32 normalize, i32* __restrict__ topk_ids, float* __restrict__ topk_w) {
  const int lane = threadIdx.x & 31;
  const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (row >= rows) return;
  const LT* l = logits + row * E;
  const int epl = (E + 31) >> 5;  // entries per lane actually used (loops below stop there)

  float v[kRouteMaxPerLane];
  u32 keys[kRouteMaxPerLane];
  float m = __int_as_float(0xff800000);  // -inf
#pragma unroll
  for (int j = 0; j < kRouteMaxPerLane; ++j) {
    if (j >= epl) break;
    const i32 e = lane + 32 * j;
    v[j] = e < E ? Traits<LT>::to_float(l[e]) : __int_as_float(0xff800000);
    keys[j] = e < E ? order_key(v[j]) : 0u;
    if (e < E) m = fmaxf(m, v[j]);
  }
  m = warp_max(m);

  if constexpr (SPARSE) {
    // Phi-3.5-MoE sparse mixer, k = 2, jitter eps = 0.01: mask j where (m - l_j) > 2 eps max(|l_j|, m)
    const float eps2 = 0.02f;
    u32 taken = 0u;
    i32 sel[2];
    float wsel[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      u32 key;
      i32 idx;
      lane_best(keys, taken, E, epl, lane, key, idx);
      warp_argmax_key(key, idx);
      // value of the winner: broadcast from its owner lane
      float win = 0.0f;
#pragma unroll
      for (int j = 0; j < kRouteMaxPerLane; ++j)
        if (j < epl && lane + 32 * j == idx) win = v[j];
      win = __shfl_sync(kFullMask, win, idx & 31);
      if ((idx & 31) == lane) taken |= 1u << (idx >> 5);
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < kRouteMaxPerLane; ++j) {
    if (j >= epl) break;
        const i32 e = lane + 32 * j;
        if (e >= E) continue;
        const bool masked = (t == 1 && e == sel[0]) || (win - v[j]) > eps2 * fmaxf(fabsf(v[j]), win);
        if (!masked) s += expf(v[j] - win);
      }
      s = warp_sum(s);
      sel[t] = idx;
      wsel[t] = 1.0f / s;
    }
    if (lane == 0) {
      topk_ids[row * 2] = sel[0];
      topk_ids[row * 2 + 1] = sel[1];
      topk_w[row * 2] = wsel[0];
      topk_w[row * 2 + 1] = wsel[1];
    }
    return;
  } else {
    float denom = 0.0f;
#pragma unroll
    for (int j = 0; j < kRouteMaxPerLane; ++j)
      if (j < epl && lane + 32 * j < E) denom += expf(v[j] - m);
    denom = warp_sum(denom);

    u32 taken = 0u;
    float wsum = 0.0f;
    float my_w = 0.0f;  // lane t keeps the weight of pick t (k <= 32)
    i32 my_id = 0;
    for (int t = 0; t < k; ++t) {
      u32 key;
      i32 idx;
      lane_best(keys, taken, E, epl, lane, key, idx);
      warp_argmax_key(key, idx);
      float val = 0.0f;
#pragma unroll
      for (int j = 0; j < kRouteMaxPerLane; ++j)
        if (j < epl && lane + 32 * j == idx) val = v[j];
      val = __shfl_sync(kFullMask, val, idx & 31);
      if ((idx & 31) == lane) taken |= 1u << (idx >> 5);
      float w;
      if constexpr (HAS_RW) {
        w = Traits<WT>::to_float(router_weights[row * E + idx]);
      } else {
        w = expf(val - m) / denom;
      }
      wsum += w;
      if (lane == t) {
        my_w = w;
        my_id = idx;
      }
    }
    if (lane < k) {
      float w = my_w;
      if (normalize) w = wsum != 0.0f ? w / wsum : 0.0f;
      topk_ids[row * k + lane] = my_id;
      topk_w[row * k + lane] = w;
    }
  }
}

}  // namespace qmoe
