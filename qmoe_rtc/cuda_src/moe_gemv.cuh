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
// One warp per output row of a route; lanes stride K in groups of 8 codes.
#pragma once

#include "dequant.cuh"
#include "moe_act.cuh"
#include "reduce.cuh"
#include "types.cuh"
#include "unpack.cuh"

namespace qmoe {

constexpr int kGemvThreads = 256;
constexpr int kGemvWarps = kGemvThreads / 32;

// sum_k w[e, n, k] * x[k] over the warp (every lane gets the sum). x: float, shared or global.
template <class QP, bool ALIGNED>
__device__ __forceinline__ float warp_dot_row(const QP& qp, const u8* __restrict__ w, i32 e, i32 n,
                                              const float* __restrict__ x, int lane) {
  constexpr int B = QP::kBits;
  constexpr int BLK = QP::kBlock;
  const u8* row = w + ((i64)e * qp.N + n) * packed_bytes<B>(qp.K);
  const i32 groups = qp.K >> 3;
  float acc = 0.0f;
  ScaleZp sz = qp.fetch(e, n, 0);
  for (i32 g = lane; g < groups; g += 32) {
    const i64 k0 = (i64)g << 3;
    if constexpr (BLK != 0) sz = qp.fetch(e, n, (i32)(k0 / BLK));
    u32 q[8];
    load_unpack8<B, ALIGNED>(row, k0, q);
    float part = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) part = fmaf((float)q[i] - sz.zp, x[k0 + i], part);
    acc = fmaf(part, sz.scale, acc);
  }
  for (i64 kk = ((i64)groups << 3) + lane; kk < qp.K; kk += 32) {  // tail: K % 8 codes
    if constexpr (BLK != 0) sz = qp.fetch(e, n, (i32)(kk / BLK));
    acc = fmaf(dequant1(code_at<B>(row, kk), sz), x[kk], acc);
  }
  return warp_sum(acc);
}

template <typename T, typename ScaleT, int B1, int Z1, int B3, int Z3, int BLOCK, int ACT, int GATE, bool ALIGNED>
__global__ void __launch_bounds__(kGemvThreads)
fc1_gemv(const T* __restrict__ x, const i32* __restrict__ ids, i32 k, i32 H, i32 I,
         const u8* __restrict__ w1, const ScaleT* __restrict__ s1, const u8* __restrict__ z1, const float* __restrict__ b1,
         const u8* __restrict__ w3, const ScaleT* __restrict__ s3, const u8* __restrict__ z3, const float* __restrict__ b3,
         float zp_offset, float alpha, float beta, float limit, i32 limit_after,
         float* __restrict__ act) {
  extern __shared__ float xs[];  // [H]
  const ActParams ap{alpha, beta, limit, limit_after};
  const i32 r = blockIdx.y;
  const i64 row = r / k;
  const i32 e = ids[r];
  for (i32 h = threadIdx.x; h < H; h += kGemvThreads) xs[h] = Traits<T>::to_float(x[row * H + h]);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const i32 i = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  if (i >= I) return;
  constexpr bool kFused = GATE == GATE_FUSED1 || GATE == GATE_FUSED2;
  const i32 N1 = kFused ? 2 * I : I;
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{s1, z1, zp_offset, N1, H};
  float a;
  if constexpr (GATE == GATE_NONE) {
    const float h = warp_dot_row<decltype(q1), ALIGNED>(q1, w1, e, i, xs, lane) + (b1 ? b1[(i64)e * N1 + i] : 0.0f);
    a = act1<ACT>(h);
  } else {
    const i32 gn = GATE == GATE_FUSED1 ? 2 * i : i;
    float g = warp_dot_row<decltype(q1), ALIGNED>(q1, w1, e, gn, xs, lane) + (b1 ? b1[(i64)e * N1 + gn] : 0.0f);
    float l;
    if constexpr (GATE == GATE_FC3) {
      const QuantParams<ScaleT, B3, BLOCK, Z3> q3{s3, z3, zp_offset, I, H};
      l = warp_dot_row<decltype(q3), ALIGNED>(q3, w3, e, i, xs, lane) + (b3 ? b3[(i64)e * I + i] : 0.0f);
    } else {
      const i32 ln = GATE == GATE_FUSED1 ? 2 * i + 1 : I + i;
      l = warp_dot_row<decltype(q1), ALIGNED>(q1, w1, e, ln, xs, lane) + (b1 ? b1[(i64)e * N1 + ln] : 0.0f);
    }
    a = act_gated<ACT>(g, l, ap);
  }
  if (lane == 0) act[(i64)r * I + i] = a;
}

template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, bool ALIGNED>
__global__ void __launch_bounds__(kGemvThreads)
fc2_gemv_combine(const float* __restrict__ act, const i32* __restrict__ ids, const float* __restrict__ wts, i32 k,
                 i32 H, i32 I, const u8* __restrict__ w2, const ScaleT* __restrict__ s2, const u8* __restrict__ z2,
                 const float* __restrict__ b2, float zp_offset, T* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const i32 n = blockIdx.x * kGemvWarps + (threadIdx.x >> 5);
  const i64 row = blockIdx.y;
  if (n >= H) return;
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{s2, z2, zp_offset, H, I};
  float total = 0.0f;
  for (i32 slot = 0; slot < k; ++slot) {
    const i64 r = row * k + slot;
    const i32 e = ids[r];
    const float y = warp_dot_row<decltype(q2), ALIGNED>(q2, w2, e, n, act + r * I, lane) + (b2 ? b2[(i64)e * H + n] : 0.0f);
    total = fmaf(wts[r], y, total);
  }
  if (lane == 0) out[row * H + n] = Traits<T>::from_float(total);
}

}  // namespace qmoe
