// moe_gemm.cuh: the prefill path, for many routes: grouped GEMMs over expert-contiguous routes
// (see moe_group.cuh), float32 SIMT tiles, then a weighted combine.
//
//   sorted        [R]       i32   route ids in expert order; offsets / tile_offsets [E + 1] i32
//   x             [rows, H] T     gathered through sorted (row = route / k)
//   act_sorted    [R, I]    f32   fc1_gemm out (sorted order), fc2_gemm in
//   y             [R, H]    f32   fc2_gemm out, by route id
//   out           [rows, H] T     combine: sum over slots of wts * y, rounded once
//
// A block computes a tile of BM (16 or 64) routes x 64 weight rows (64 outputs, or 32 gated pairs)
// over K in steps of 32, dequantizing the weights into shared memory. Grid x is an upper bound on
// the tiles (R/BM + E); blocks past tile_offsets[E] exit at once.
#pragma once

#include "dequant.cuh"
#include "moe_act.cuh"
#include "types.cuh"
#include "unpack.cuh"

namespace qmoe {

constexpr int kGemmThreads = 256;
constexpr int kGemmBW = 64;  // weight rows per tile
// Routes per tile (BM) is a template parameter: 64, or 16 when experts get few routes each (a
// 64-row tile would mostly multiply padding).
constexpr int kGemmBK = 32;  // K step

// Expert and first sorted position of tile t; false for a tile past the last one.
template <int BM>
__device__ __forceinline__ bool find_tile(const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets, i32 E,
                                          i32 t, i32& e, i32& m0, i32& m_end) {
  if (t >= tile_offsets[E]) return false;
  i32 lo = 0, hi = E - 1;  // largest e with tile_offsets[e] <= t (experts with no tiles are skipped)
  while (lo < hi) {
    const i32 mid = (lo + hi + 1) >> 1;
    if (tile_offsets[mid] <= t) lo = mid; else hi = mid - 1;
  }
  e = lo;
  m0 = offsets[e] + (t - tile_offsets[e]) * BM;
  m_end = min(m0 + BM, offsets[e + 1]);
  return true;
}

// Eight dequantized weights w[e, n, k0 .. k0+8) (zeros past K), as float32.
template <class QP, bool ALIGNED>
__device__ __forceinline__ void dequant_group(const QP& qp, const u8* __restrict__ w, i32 e, i32 n, i64 k0, float (&out)[8]) {
  constexpr int B = QP::kBits;
  const u8* row = w + ((i64)e * qp.N + n) * packed_bytes<B>(qp.K);
  if (k0 + 8 <= qp.K) {
    const ScaleZp sz = qp.fetch(e, n, QP::block_of(k0));
    u32 q[8];
    load_unpack8<B, ALIGNED>(row, k0, q);
    dequant8(q, sz, out);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const i64 kk = k0 + i;
      out[i] = kk < qp.K ? dequant1(code_at<B>(row, kk), qp.fetch(e, n, QP::block_of(kk))) : 0.0f;
    }
  }
}

// The 64x32 weight tile (rows c of the tile -> rows of W1 / W3 chosen by GATE) into Bs[k][c].
// Each of the 256 threads dequantizes 8 codes: row c = tid / 4, k-group tid % 4.
template <class QA, class QB, int GATE, bool ALIGNED>
__device__ __forceinline__ void load_weight_tile(const QA& qa, const u8* __restrict__ wa, const QB& qb,
                                                 const u8* __restrict__ wb, i32 e, i32 c0, i32 n_out, i64 k0,
                                                 float (*Bs)[kGemmBW + 4]) {
  const int c = threadIdx.x >> 2, g = threadIdx.x & 3;
  float v[8];
  // output index and which tensor/row this tile row reads
  i32 o, n;
  bool from_b = false;
  if constexpr (GATE == GATE_NONE) {
    o = c0 + c;
    n = o;
  } else {
    o = c0 / 2 + (c >> 1);
    const bool lin = c & 1;
    if constexpr (GATE == GATE_FUSED1) n = 2 * o + lin;
    else if constexpr (GATE == GATE_FUSED2) n = lin ? n_out + o : o;
    else { n = o; from_b = lin; }
  }
  if (o < n_out) {
    if constexpr (GATE == GATE_FC3) {
      if (from_b) dequant_group<QB, ALIGNED>(qb, wb, e, n, k0 + 8 * g, v);
      else dequant_group<QA, ALIGNED>(qa, wa, e, n, k0 + 8 * g, v);
    } else {
      dequant_group<QA, ALIGNED>(qa, wa, e, n, k0 + 8 * g, v);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) Bs[8 * g + i][c] = v[i];
}

// acc[TM][4] += A[BM x BK] * B[BK x BW] for this thread's TM = BM/16 rows (ty) x 4 columns (tx).
template <int BM>
__device__ __forceinline__ void mma_tile(float (*As)[BM + 4], float (*Bs)[kGemmBW + 4], float (&acc)[BM / 16][4]) {
  constexpr int TM = BM / 16;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll 8
  for (int kk = 0; kk < kGemmBK; ++kk) {
    float a[TM], b[4];
#pragma unroll
    for (int i = 0; i < TM; ++i) a[i] = As[kk][ty * TM + i];
#pragma unroll
    for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx * 4 + j];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
  }
}

// FC1 (+FC3) with the activation fused: act_sorted[m, i] for the tile's routes.
template <typename T, typename ScaleT, int B1, int Z1, int B3, int Z3, int BLOCK, int ACT, int GATE, bool ALIGNED, int BM>
__global__ void __launch_bounds__(kGemmThreads)
fc1_gemm(const T* __restrict__ x, const i32* __restrict__ sorted, const i32* __restrict__ offsets,
         const i32* __restrict__ tile_offsets, i32 E, i32 k, i32 H, i32 I,
         const u8* __restrict__ w1, const ScaleT* __restrict__ s1, const u8* __restrict__ z1, const float* __restrict__ b1,
         const u8* __restrict__ w3, const ScaleT* __restrict__ s3, const u8* __restrict__ z3, const float* __restrict__ b3,
         float zp_offset, float alpha, float beta, float limit, i32 limit_after,
         float* __restrict__ act_sorted) {
  constexpr int TM = BM / 16, TPR = kGemmThreads / BM, EPT = kGemmBK / TPR;  // A tile: TPR threads per row
  __shared__ float As[kGemmBK][BM + 4];
  __shared__ float Bs[kGemmBK][kGemmBW + 4];
  __shared__ i64 src_row[BM];
  const ActParams ap{alpha, beta, limit, limit_after};
  i32 e, m0, m_end;
  if (!find_tile<BM>(offsets, tile_offsets, E, blockIdx.x, e, m0, m_end)) return;
  constexpr bool kGated = GATE != GATE_NONE;
  constexpr bool kFused = GATE == GATE_FUSED1 || GATE == GATE_FUSED2;
  const i32 N1 = kFused ? 2 * I : I;
  const i32 c0 = blockIdx.y * kGemmBW;  // first tile column (weight-row slot)
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{s1, z1, zp_offset, N1, H};
  const QuantParams<ScaleT, B3, BLOCK, Z3> q3{s3, z3, zp_offset, I, H};
  for (int m = threadIdx.x; m < BM; m += kGemmThreads)
    src_row[m] = m0 + m < m_end ? (i64)(sorted[m0 + m] / k) : -1;
  __syncthreads();

  float acc[TM][4] = {};
  for (i64 k0 = 0; k0 < H; k0 += kGemmBK) {
    // A tile: BM routes x 32 inputs, EPT per thread
    {
      const int m = threadIdx.x / TPR, kq = (threadIdx.x % TPR) * EPT;
      const i64 sr = src_row[m];
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const i64 kk = k0 + kq + i;
        As[kq + i][m] = (sr >= 0 && kk < H) ? Traits<T>::to_float(x[sr * H + kk]) : 0.0f;
      }
    }
    load_weight_tile<decltype(q1), decltype(q3), GATE, ALIGNED>(q1, w1, q3, w3, e, c0, I, k0, Bs);
    __syncthreads();
    mma_tile<BM>(As, Bs, acc);
    __syncthreads();
  }

  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const i32 m = m0 + ty * TM + i;
    if (m >= m_end) continue;
    if constexpr (!kGated) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const i32 n = c0 + tx * 4 + j;
        if (n < I) act_sorted[(i64)m * I + n] = act1<ACT>(acc[i][j] + (b1 ? b1[(i64)e * N1 + n] : 0.0f));
      }
    } else {
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const i32 o = c0 / 2 + tx * 2 + p;
        if (o >= I) continue;
        const i32 gn = GATE == GATE_FUSED1 ? 2 * o : o;
        float g = acc[i][2 * p] + (b1 ? b1[(i64)e * N1 + gn] : 0.0f);
        float l = acc[i][2 * p + 1];
        if constexpr (GATE == GATE_FC3) l += b3 ? b3[(i64)e * I + o] : 0.0f;
        else l += b1 ? b1[(i64)e * N1 + (GATE == GATE_FUSED1 ? 2 * o + 1 : I + o)] : 0.0f;
        act_sorted[(i64)m * I + o] = act_gated<ACT>(g, l, ap);
      }
    }
  }
}

// FC2: y[route, n] = act_sorted[m] . W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
template <typename ScaleT, int B2, int Z2, int BLOCK, bool ALIGNED, int BM>
__global__ void __launch_bounds__(kGemmThreads)
fc2_gemm(const float* __restrict__ act_sorted, const i32* __restrict__ sorted, const i32* __restrict__ offsets,
         const i32* __restrict__ tile_offsets, i32 E, i32 H, i32 I,
         const u8* __restrict__ w2, const ScaleT* __restrict__ s2, const u8* __restrict__ z2, const float* __restrict__ b2,
         float zp_offset, float* __restrict__ y) {
  constexpr int TM = BM / 16, TPR = kGemmThreads / BM, EPT = kGemmBK / TPR;
  __shared__ float As[kGemmBK][BM + 4];
  __shared__ float Bs[kGemmBK][kGemmBW + 4];
  i32 e, m0, m_end;
  if (!find_tile<BM>(offsets, tile_offsets, E, blockIdx.x, e, m0, m_end)) return;
  const i32 c0 = blockIdx.y * kGemmBW;
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{s2, z2, zp_offset, H, I};
  float acc[TM][4] = {};
  for (i64 k0 = 0; k0 < I; k0 += kGemmBK) {
    {
      const int m = threadIdx.x / TPR, kq = (threadIdx.x % TPR) * EPT;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const i64 kk = k0 + kq + i;
        As[kq + i][m] = (m0 + m < m_end && kk < I) ? act_sorted[(i64)(m0 + m) * I + kk] : 0.0f;
      }
    }
    load_weight_tile<decltype(q2), decltype(q2), GATE_NONE, ALIGNED>(q2, w2, q2, w2, e, c0, H, k0, Bs);
    __syncthreads();
    mma_tile<BM>(As, Bs, acc);
    __syncthreads();
  }
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const i32 m = m0 + ty * TM + i;
    if (m >= m_end) continue;
    const i64 route = sorted[m];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const i32 n = c0 + tx * 4 + j;
      if (n < H) y[route * H + n] = acc[i][j] + (b2 ? b2[(i64)e * H + n] : 0.0f);
    }
  }
}

// out[row, n] = sum_slot wts[row*k + slot] * y[row*k + slot, n], rounded once to T.
template <typename T>
__global__ void combine_routes(const float* __restrict__ y, const float* __restrict__ wts, i32 rows, i32 k, i32 H,
                               T* __restrict__ out) {
  const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (i64)rows * H) return;
  const i64 row = idx / H, n = idx - row * H;
  float total = 0.0f;
  for (i32 slot = 0; slot < k; ++slot) {
    const i64 r = row * k + slot;
    total = fmaf(wts[r], y[r * H + n], total);
  }
  out[idx] = Traits<T>::from_float(total);
}

}  // namespace qmoe
