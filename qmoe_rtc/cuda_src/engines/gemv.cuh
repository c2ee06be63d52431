// engines/gemv.cuh: the SIMT decode path, for few expanded rows (routes). No grouping pass: each route reads
// its expert's rows directly; FC1 fuses the activation, FC2 fuses the weighted combine.
//
//   x        [rows, H]        T      input rows
//   ids, topk_w [R]           i32, f32   route r = row*k + slot (from route_topk)
//   W1       [E, N1, ceil(H*b1/8)] u8, N1 = F*I      (+ scales, zero points, bias [E, N1] f32)
//   W3       [E, I, ceil(H*b3/8)]  u8                (GATE_FC3 only)
//   act      [R, I]           T      fc1_gemv out (the activation, rounded to T), fc2_gemv_combine in
//   W2       [E, H, ceil(I*b2/8)]  u8
//   out      [rows, H]        T      sum over the k routes of topk_w * (act . W2^T + b2), rounded once
//
// Both kernels give a 128-thread block a few weight rows and spread every (term, K item) pair of
// them over all its threads (engines/dot.cuh), two items in flight per thread; a fixed-order block sum
// then finishes each row (deterministic). Many small blocks keep every SM's loads in flight.
//   fc1_gemv: block = (route, 2 groups of 4 weight rows) = 4 gated outputs or 8 plain ones.
//   fc2_gemv_combine: block = (token row, 4 outputs); terms = the row's k routes.
// Grids put the route / token row on blockIdx.x (launched fastest): blocks that read the same
// expert rows for different tokens run together and share them through L2.
#pragma once

#include "core/dequant.cuh"
#include "core/experts.cuh"
#include "core/types.cuh"
#include "engines/dot.cuh"
#include "epilogue/fc1.cuh"

namespace qmoe {

inline constexpr int kGemvThreads = 128;
inline constexpr int kFc1Groups = 2;  // groups of 4 weight rows per fc1 block
inline constexpr int kFc2Rows = 4;    // outputs per fc2 block

template <int GATE> struct Fc1Shape {
  static constexpr bool kGated = GATE != GATE_NONE;
  static constexpr int kOutPerGroup = kGated ? 2 : 4;  // 4 weight rows either way
  static constexpr int kOut = kOutPerGroup * kFc1Groups;
};

template <typename T, typename ScaleT, int B1, int Z1, int B3, int Z3, int BLOCK, int ACT, int GATE, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
fc1_gemv(const T* __restrict__ x, const i32* __restrict__ ids, i32 k, i32 H, i32 I,
         const Fc1Weights<ScaleT> wt, const ActParams ap, T* __restrict__ act) {
  __shared__ float red[kGemvThreads / 32 * kFc1Groups * 4];
  using Shape = Fc1Shape<GATE>;
  using Rows = Fc1Rows<GATE>;
  constexpr int OPG = Shape::kOutPerGroup;
  const i32 r = blockIdx.x;
  i32 e = ids[r];
  if (e < 0) return;  // an expert this layer does not hold (expert slices [ext]): FC2 skips the route too
  const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
  const Proj<ScaleT>& p3 = wt.fc3;
  const T* xr = x + (i64)(r / k) * H;
  const i32 N1 = Rows::n1(I);
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{p1.scales, p1.zp, wt.zp_offset, N1, H};
  const QuantParams<ScaleT, B3, BLOCK, Z3> q3{p3.scales, p3.zp, wt.zp_offset, I, H};
  const i32 o0 = blockIdx.y * Shape::kOut;

  // weight rows of group g: plain: outputs o..o+3; gated: gate rows of 2 outputs, then their linear rows
  // (GATE_FC3: rows 0-1 from W1, 2-3 from W3)
  i32 n[kFc1Groups][4];
#pragma unroll
  for (int g = 0; g < kFc1Groups; ++g) {
#pragma unroll
    for (int j = 0; j < OPG; ++j) {
      const i32 o = min(o0 + g * OPG + j, I - 1);  // clamped: computed, never stored
      n[g][j] = Rows::gate_row(o, I);
      if constexpr (Shape::kGated) n[g][OPG + j] = Rows::lin_row(o, I);
    }
  }
  float acc[kFc1Groups][4] = {};
  const i32 per_group = items_of<VEC>(H);
  const i32 items = kFc1Groups * per_group;
  auto item = [&](i32 t) {
    const i32 g = t / per_group, it = t - g * per_group;
#pragma unroll
    for (int gg = 0; gg < kFc1Groups; ++gg) {  // constant group index keeps acc / n in registers
      if (gg != g) continue;
      if constexpr (GATE == GATE_FC3) {
        const i32 na[2] = {n[gg][0], n[gg][1]}, nb[2] = {n[gg][2], n[gg][3]};
        float aa[2] = {acc[gg][0], acc[gg][1]}, ab[2] = {acc[gg][2], acc[gg][3]};
        accum_item<2, VEC>(q1, p1.w, e, na, xr, it, 1.0f, aa);
        accum_item<2, VEC>(q3, p3.w, e, nb, xr, it, 1.0f, ab);
        acc[gg][0] = aa[0]; acc[gg][1] = aa[1]; acc[gg][2] = ab[0]; acc[gg][3] = ab[1];
      } else {
        accum_item<4, VEC>(q1, p1.w, e, n[gg], xr, it, 1.0f, acc[gg]);
      }
    }
  };
  for (i32 t = threadIdx.x; t < items; t += 2 * kGemvThreads) {
    item(t);
    if (t + kGemvThreads < items) item(t + kGemvThreads);
  }
  float hs[kFc1Groups * 4];
#pragma unroll
  for (int g = 0; g < kFc1Groups; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j) hs[g * 4 + j] = acc[g][j];
  block_sums_fixed<kGemvThreads, kFc1Groups * 4>(hs, red);
  float h[kFc1Groups][4];
#pragma unroll
  for (int g = 0; g < kFc1Groups; ++g)
#pragma unroll
    for (int j = 0; j < 4; ++j) h[g][j] = hs[g * 4 + j];
  if (threadIdx.x < Shape::kOut) {
    const int g = threadIdx.x / OPG, j = threadIdx.x % OPG;
    const i32 o = o0 + threadIdx.x;
    if (o < I) {
      float hv[4];
#pragma unroll
      for (int gg = 0; gg < kFc1Groups; ++gg)
        if (gg == g) { hv[0] = h[gg][0]; hv[1] = h[gg][1]; hv[2] = h[gg][2]; hv[3] = h[gg][3]; }
      float gate = 0.0f, lin = 0.0f;
#pragma unroll
      for (int jj = 0; jj < OPG; ++jj)
        if (jj == j) { gate = hv[jj]; if constexpr (Shape::kGated) lin = hv[OPG + jj]; }
      act[(i64)r * I + o] = Traits<T>::from_float(fc1_activation<ACT, GATE>(gate, lin, p1.bias, p3.bias, e, o, I, ap));
    }
  }
}

template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, bool VEC>
__global__ void __launch_bounds__(kGemvThreads)
fc2_gemv_combine(const T* __restrict__ act, const i32* __restrict__ ids, const float* __restrict__ topk_w, i32 k,
                 i32 H, i32 I, const Fc2Weights<ScaleT> wt, T* __restrict__ out) {
  __shared__ float red[kGemvThreads / 32 * kFc2Rows];
  const i64 row = blockIdx.x;
  const i32 n0 = blockIdx.y * kFc2Rows;
  const Proj<ScaleT>& p2 = wt.fc2, &ps = wt.shared_fc2;  // routed, shared experts [ext] (core/experts.cuh)
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{p2.scales, p2.zp, wt.zp_offset, H, I};
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2s{ps.scales, ps.zp, wt.zp_offset, H, I};
  i32 n[kFc2Rows];
#pragma unroll
  for (int j = 0; j < kFc2Rows; ++j) n[j] = min(n0 + j, H - 1);
  float acc[kFc2Rows] = {};
  const i32 per_slot = items_of<VEC>(I);
  const i32 items = k * per_slot;
  auto item = [&](i32 t) {
    const i32 slot = t / per_slot, it = t - slot * per_slot;
    const i64 r = row * k + slot;
    const i32 e = ids[r];
    if (e < 0) return;  // not held here (expert slices [ext]): contributes nothing
    const bool sh = e >= wt.E_routed;  // a shared expert's slot (core/experts.cuh)
    accum_item<kFc2Rows, VEC>(sh ? q2s : q2, sh ? ps.w : p2.w, sh ? e - wt.E_routed : e, n, act + r * I, it, topk_w[r], acc);
  };
  for (i32 t = threadIdx.x; t < items; t += 2 * kGemvThreads) {
    item(t);
    if (t + kGemvThreads < items) item(t + kGemvThreads);
  }
  block_sums_fixed<kGemvThreads, kFc2Rows>(acc, red);
  const float (&y)[kFc2Rows] = acc;
  if (threadIdx.x < kFc2Rows && n0 + (i32)threadIdx.x < H) {
    const i32 nn = n0 + threadIdx.x;
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < kFc2Rows; ++j) if (j == (int)threadIdx.x) v = y[j];
    if (p2.bias || ps.bias) {
      for (i32 slot = 0; slot < k; ++slot) {  // slot order: deterministic
        const i64 r = row * k + slot;
        const i32 e = ids[r];
        if (e < 0) continue;
        const float* bias = e >= wt.E_routed ? ps.bias : p2.bias;
        if (bias) v = fmaf(topk_w[r], __ldg(bias + (i64)(e >= wt.E_routed ? e - wt.E_routed : e) * H + nn), v);
      }
    }
    out[row * H + nn] = Traits<T>::from_float(v);
  }
}

}  // namespace qmoe
