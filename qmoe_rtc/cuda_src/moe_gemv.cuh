// moe_gemv.cuh: the decode path, for few expanded rows (routes). No grouping pass: each route reads
// its expert's rows directly; FC1 fuses the activation, FC2 fuses the weighted combine.
//
//   x        [rows, H]        T      input rows
//   ids, wts [R]              i32, f32   route r = row*k + slot (from route_topk)
//   W1       [E, N1, ceil(H*b1/8)] u8, N1 = F*I      (+ scales, zero points, bias [E, N1] f32)
//   W3       [E, I, ceil(H*b3/8)]  u8                (GATE_FC3 only)
//   act      [R, I]           f32    (fc1_gemv out, fc2_gemv_combine in)
//   W2       [E, H, ceil(I*b2/8)]  u8
//   out      [rows, H]        T      sum over the k routes of wts * (act . W2^T + b2), rounded once
//
// fc1_gemv: block = (route, 4 warps); a warp computes kFc1Out outputs (gate + linear rows when
// gated: 4 weight rows), sharing each x chunk across them (moe_dot.cuh).
// fc2_gemv_combine: block = (token row, kFc2Rows outputs); it stages the row's k activation vectors in
// shared memory, its 4 warps split the k routes x row groups, then reduce in a fixed order.
// Grids put the route (fc1) / token row (fc2) on blockIdx.x, the fastest-launched dimension: blocks
// that read the same expert rows for different tokens run together and share them through L2.
#pragma once

#include "dequant.cuh"
#include "moe_act.cuh"
#include "moe_dot.cuh"
#include "reduce.cuh"
#include "types.cuh"

namespace qmoe {

constexpr int kGemvThreads = 128;
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kFc2Rows = 16;  // outputs per fc2 block
constexpr int kFc2Group = 4;  // outputs per warp work unit

template <int GATE> struct Fc1Shape {
  static constexpr bool kGated = GATE != GATE_NONE;
  static constexpr int kOut = kGated ? 2 : 4;  // outputs per warp (4 weight rows either way)
};

template <typename T, typename ScaleT, int B1, int Z1, int B3, int Z3, int BLOCK, int ACT, int GATE, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
fc1_gemv(const T* __restrict__ x, const i32* __restrict__ ids, i32 k, i32 H, i32 I,
         const u8* __restrict__ w1, const ScaleT* __restrict__ s1, const u8* __restrict__ z1, const float* __restrict__ b1,
         const u8* __restrict__ w3, const ScaleT* __restrict__ s3, const u8* __restrict__ z3, const float* __restrict__ b3,
         float zp_offset, float alpha, float beta, float limit, i32 limit_after, float* __restrict__ act) {
  extern __shared__ __align__(16) float xs[];  // [H]
  const ActParams ap{alpha, beta, limit, limit_after};
  constexpr int OUT = Fc1Shape<GATE>::kOut;
  const i32 r = blockIdx.x;
  const i64 row = r / k;
  const i32 e = ids[r];
  stage_to_smem<kGemvThreads, VEC>(xs, x + row * H, H);
  const int lane = threadIdx.x & 31;
  const i32 i0 = (blockIdx.y * kGemvWarps + (threadIdx.x >> 5)) * OUT;
  if (i0 >= I) return;
  constexpr bool kFused = GATE == GATE_FUSED1 || GATE == GATE_FUSED2;
  const i32 N1 = kFused ? 2 * I : I;
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{s1, z1, zp_offset, N1, H};
  i32 o[OUT];
#pragma unroll
  for (int j = 0; j < OUT; ++j) o[j] = min(i0 + j, I - 1);  // clamp: computed, not stored
  float a[OUT];
  if constexpr (GATE == GATE_NONE) {
    float h[4];
    warp_dot_rows<4, VEC>(q1, w1, e, o, xs, lane, h);
#pragma unroll
    for (int j = 0; j < OUT; ++j) a[j] = act1<ACT>(h[j] + (b1 ? b1[(i64)e * N1 + o[j]] : 0.0f));
  } else if constexpr (GATE == GATE_FC3) {
    const QuantParams<ScaleT, B3, BLOCK, Z3> q3{s3, z3, zp_offset, I, H};
    float g[OUT], l[OUT];
    warp_dot_rows<OUT, VEC>(q1, w1, e, o, xs, lane, g);
    warp_dot_rows<OUT, VEC>(q3, w3, e, o, xs, lane, l);
#pragma unroll
    for (int j = 0; j < OUT; ++j)
      a[j] = act_gated<ACT>(g[j] + (b1 ? b1[(i64)e * I + o[j]] : 0.0f), l[j] + (b3 ? b3[(i64)e * I + o[j]] : 0.0f), ap);
  } else {
    i32 n[2 * OUT];  // gate rows then linear rows
#pragma unroll
    for (int j = 0; j < OUT; ++j) {
      n[j] = GATE == GATE_FUSED1 ? 2 * o[j] : o[j];
      n[OUT + j] = GATE == GATE_FUSED1 ? 2 * o[j] + 1 : I + o[j];
    }
    float h[2 * OUT];
    warp_dot_rows<2 * OUT, VEC>(q1, w1, e, n, xs, lane, h);
#pragma unroll
    for (int j = 0; j < OUT; ++j)
      a[j] = act_gated<ACT>(h[j] + (b1 ? b1[(i64)e * N1 + n[j]] : 0.0f),
                            h[OUT + j] + (b1 ? b1[(i64)e * N1 + n[OUT + j]] : 0.0f), ap);
  }
  if (lane < OUT && i0 + lane < I) {
    float v = a[0];
#pragma unroll
    for (int j = 1; j < OUT; ++j) if (lane == j) v = a[j];
    act[(i64)r * I + i0 + lane] = v;
  }
}

template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
fc2_gemv_combine(const float* __restrict__ act, const i32* __restrict__ ids, const float* __restrict__ wts, i32 k,
                 i32 H, i32 I, const u8* __restrict__ w2, const ScaleT* __restrict__ s2, const u8* __restrict__ z2,
                 const float* __restrict__ b2, float zp_offset, T* __restrict__ out) {
  extern __shared__ __align__(16) float acts[];  // [k, I]: this row's k activation vectors
  __shared__ float red[kGemvWarps][kFc2Rows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i64 row = blockIdx.x;
  const i32 n0 = blockIdx.y * kFc2Rows;
  if (lane < kFc2Rows) red[warp][lane] = 0.0f;
  stage_to_smem<kGemvThreads, VEC>(acts, act + row * k * I, k * I);
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{s2, z2, zp_offset, H, I};
  constexpr int kGroups = kFc2Rows / kFc2Group;
  // work unit u = (slot, row group); warp w takes u = w, w + 4, ... and adds into its own red[w]
  for (i32 u = warp; u < k * kGroups; u += kGemvWarps) {
    const i32 slot = u / kGroups, grp = u % kGroups;
    const i64 r = row * k + slot;
    const i32 e = ids[r];
    const float wr = wts[r];
    i32 n[kFc2Group];
#pragma unroll
    for (int j = 0; j < kFc2Group; ++j) n[j] = min(n0 + grp * kFc2Group + j, H - 1);
    float y[kFc2Group];
    warp_dot_rows<kFc2Group, VEC>(q2, w2, e, n, acts + slot * I, lane, y, slot * (I >> 5));
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kFc2Group; ++j) red[warp][grp * kFc2Group + j] += wr * (y[j] + (b2 ? b2[(i64)e * H + n[j]] : 0.0f));
    }
  }
  __syncthreads();
  if (threadIdx.x < kFc2Rows && n0 + (i32)threadIdx.x < H) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kGemvWarps; ++w) total += red[w][threadIdx.x];  // fixed order: deterministic
    out[row * H + n0 + threadIdx.x] = Traits<T>::from_float(total);
  }
}

}  // namespace qmoe
