// engines/gemm_simt.cuh: the SIMT prefill engine, for layouts the tensor-core engine does not take
// (float32 activations, zero_point_offset, sizes not multiples of 32): grouped GEMMs over
// expert-contiguous routes (routing/group.cuh) in float32, then the weighted combine (epilogue/combine.cuh).
//
//   rg            RouteGroups  sorted [R] i32 route ids in expert order; offsets / tile_offsets [E + 1] i32
//   x             [rows, H] T     gathered through sorted (row = route / k)
//   act_sorted    [R, I]    f32   fc1_gemm out (sorted order), fc2_gemm in
//   y             [R, H]    f32   fc2_gemm out, by route id (bias added, routing weight not applied)
//
// A block computes a tile of BR (16 or 64) routes x 64 weight rows (64 outputs, or 32 gated pairs)
// over K in steps of 32, dequantizing the weights into shared memory. Grid x is an upper bound on
// the tiles (R/BR + E); blocks past tile_offsets[E] exit at once. FC1 and FC2 share one main loop.
#pragma once

#include "core/dequant.cuh"
#include "core/experts.cuh"
#include "core/types.cuh"
#include "core/unpack.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "routing/group.cuh"
#include "routing/route_group.cuh"

namespace qmoe {

inline constexpr int kGemmThreads = 256;
inline constexpr int kGemmBW = 64;  // weight rows per tile
inline constexpr int kGemmBK = 32;  // K step

// Eight dequantized weights w[e, n, k0 .. k0+8) (zeros past K), as float32.
template <class QP, bool ALIGNED>
__device__ __forceinline__ void dequant_group(const QP& qp, const u8* __restrict__ w, i32 e, i32 n, i64 k0, float (&out)[8]) {
  constexpr int B = QP::kBits;
  const u8* row = w + ((i64)e * qp.N + n) * packed_bytes<B>(qp.K);
  if (k0 + 8 <= qp.K) {
    const ScaleZp sz = qp.fetch(e, n, QP::block_of(k0));
    u32 q[8];
    load_unpack8<B, ALIGNED>(row, k0, q);
    QP::weights8(q, sz, out);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const i64 kk = k0 + i;
      out[i] = kk < qp.K ? QP::weight(code_at<B>(row, kk), qp.fetch(e, n, QP::block_of(kk))) : 0.0f;
    }
  }
}

// The 64x32 weight tile into Bs[k][c]: tile column c reads output o's gate row (even c) or linear
// row (odd c) when gated (rows of FC1, or FC3 for the linear half under GATE_FC3), else row c0 + c.
// Each of the 256 threads dequantizes 8 codes: column c = tid / 4, k-group tid % 4.
template <class QA, class QB, int GATE, bool ALIGNED>
__device__ __forceinline__ void load_weight_tile(const QA& qa, const u8* __restrict__ wa, const QB& qb,
                                                 const u8* __restrict__ wb, i32 e, i32 c0, i32 n_out, i64 k0,
                                                 float (*Bs)[kGemmBW + 4]) {
  using Rows = Fc1Rows<GATE>;
  const int c = threadIdx.x >> 2, g = threadIdx.x & 3;
  const i32 o = Rows::kGated ? c0 / 2 + (c >> 1) : c0 + c;
  const bool lin = Rows::kGated && (c & 1);
  float v[8];
  if (o < n_out) {
    const i32 n = lin ? Rows::lin_row(o, n_out) : Rows::gate_row(o, n_out);
    if (GATE == GATE_FC3 && lin) dequant_group<QB, ALIGNED>(qb, wb, e, n, k0 + 8 * g, v);
    else dequant_group<QA, ALIGNED>(qa, wa, e, n, k0 + 8 * g, v);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) Bs[8 * g + i][c] = v[i];
}

// The main loop both kernels share: acc[TM][4] = A[BR rows] · W[64 tile columns]ᵀ over K. Row m of A
// starts at a + src[m] (src[m] < 0: a padding row, read as zeros).
template <int BR, typename AT, class QA, class QB, int GATE, bool ALIGNED>
__device__ __forceinline__ void simt_tile(const AT* __restrict__ a, const i64* src, i64 K, const QA& qa,
                                          const u8* __restrict__ wa, const QB& qb, const u8* __restrict__ wb, i32 e,
                                          i32 c0, i32 n_out, float (&acc)[BR / 16][4]) {
  constexpr int TM = BR / 16, TPR = kGemmThreads / BR, EPT = kGemmBK / TPR;  // A tile: TPR threads per row
  __shared__ float As[kGemmBK][BR + 4];
  __shared__ float Bs[kGemmBK][kGemmBW + 4];
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  for (i64 k0 = 0; k0 < K; k0 += kGemmBK) {
    {
      const int m = threadIdx.x / TPR, kq = (threadIdx.x % TPR) * EPT;
      const i64 sr = src[m];
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const i64 kk = k0 + kq + i;
        As[kq + i][m] = (sr >= 0 && kk < K) ? Traits<AT>::to_float(a[sr + kk]) : 0.0f;
      }
    }
    load_weight_tile<QA, QB, GATE, ALIGNED>(qa, wa, qb, wb, e, c0, n_out, k0, Bs);
    __syncthreads();
#pragma unroll 8
    for (int kk = 0; kk < kGemmBK; ++kk) {
      float av[TM], bv[4];
#pragma unroll
      for (int i = 0; i < TM; ++i) av[i] = As[kk][ty * TM + i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = Bs[kk][tx * 4 + j];
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
}

// FC1 (+FC3) with the activation fused: act_sorted[m, o] for the tile's routes.
template <typename T, typename ScaleT, int B1, int Z1, int B3, int Z3, int BLOCK, int ACT, int GATE, bool ALIGNED, int BR>
__global__ void __launch_bounds__(kGemmThreads)
fc1_gemm(const T* __restrict__ x, const RouteGroups rg, i32 E, i32 k, i32 H, i32 I,
         const Fc1Weights<ScaleT> wt, const ActParams ap, float* __restrict__ act_sorted) {
  using Rows = Fc1Rows<GATE>;
  constexpr int TM = BR / 16;
  __shared__ i64 src[BR];
  i32 e, m0, m_end;
  if (!find_tile<BR>(rg.offsets, rg.tile_offsets, E, blockIdx.x, e, m0, m_end)) return;
  const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
  const Proj<ScaleT>& p3 = wt.fc3;
  const i32 c0 = blockIdx.y * kGemmBW;  // first tile column
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{p1.scales, p1.zp, wt.zp_offset, Rows::n1(I), H};
  const QuantParams<ScaleT, B3, BLOCK, Z3> q3{p3.scales, p3.zp, wt.zp_offset, I, H};
  for (int m = threadIdx.x; m < BR; m += kGemmThreads)
    src[m] = m0 + m < m_end ? (i64)(rg.sorted[m0 + m] / k) * H : -1;
  __syncthreads();
  float acc[TM][4] = {};
  simt_tile<BR, T, decltype(q1), decltype(q3), GATE, ALIGNED>(x, src, H, q1, p1.w, q3, p3.w, e, c0, I, acc);

  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const i32 m = m0 + ty * TM + i;
    if (m >= m_end) continue;
    if constexpr (!Rows::kGated) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const i32 o = c0 + tx * 4 + j;
        if (o < I) act_sorted[(i64)m * I + o] = fc1_activation<ACT, GATE>(acc[i][j], 0.0f, p1.bias, p3.bias, e, o, I, ap);
      }
    } else {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const i32 o = c0 / 2 + tx * 2 + p;
        if (o < I) act_sorted[(i64)m * I + o] = fc1_activation<ACT, GATE>(acc[i][2 * p], acc[i][2 * p + 1], p1.bias, p3.bias, e, o, I, ap);
      }
    }
  }
}

// FC2: y[route, n] = act_sorted[m] · W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
template <typename ScaleT, int B2, int Z2, int BLOCK, bool ALIGNED, int BR>
__global__ void __launch_bounds__(kGemmThreads)
fc2_gemm(const float* __restrict__ act_sorted, const RouteGroups rg, i32 E, i32 H, i32 I,
         const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  constexpr int TM = BR / 16;
  __shared__ i64 src[BR];
  i32 e, m0, m_end;
  if (!find_tile<BR>(rg.offsets, rg.tile_offsets, E, blockIdx.x, e, m0, m_end)) return;
  const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
  const i32 c0 = blockIdx.y * kGemmBW;
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{p2.scales, p2.zp, wt.zp_offset, H, I};
  for (int m = threadIdx.x; m < BR; m += kGemmThreads) src[m] = m0 + m < m_end ? (i64)(m0 + m) * I : -1;
  __syncthreads();
  float acc[TM][4] = {};
  simt_tile<BR, float, decltype(q2), decltype(q2), GATE_NONE, ALIGNED>(act_sorted, src, I, q2, p2.w, q2, p2.w, e, c0, H, acc);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const i32 m = m0 + ty * TM + i;
    if (m >= m_end) continue;
    const i64 route = rg.sorted[m];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const i32 n = c0 + tx * 4 + j;
      if (n < H) y[route * H + n] = acc[i][j] + (p2.bias ? __ldg(p2.bias + (i64)e * H + n) : 0.0f);
    }
  }
}

}  // namespace qmoe
