// moe_dot.cuh: a warp's dot products of RW packed weight rows of one expert with one float vector,
// the inner loop of the decode path.
//
// VEC (K % 32 == 0, rows 16-byte aligned): lane l takes chunks c = l, l + 32, ... of 32 codes
// (4*b bytes: one 16-byte load for 4-bit, two for 8-bit, 8/4/12 bytes for 2/1/3-bit) and the
// matching 32 x values, and reuses that x chunk for all RW rows:
//     sum_j (q_j - zp) * x_j * s  =  s * (sum_j q_j x_j - zp * sum_j x_j)
// Codes become floats exactly through the 2^23 mantissa trick (no int->float conversions).
// !VEC: groups of 8 codes and a scalar tail (any K, any alignment).
#pragma once

#include "dequant.cuh"
#include "reduce.cuh"
#include "types.cuh"
#include "unpack.cuh"

namespace qmoe {

// 32 codes = 4*B bytes at p (aligned to min(16, 4*B) bytes; 3-bit: 4 bytes), as B words.
template <int B> __device__ __forceinline__ void load_chunk32(const u8* __restrict__ p, u32 (&w)[B]) {
  if constexpr (B == 4) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (B == 8) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(p));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(p) + 1);
    w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w; w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
  } else if constexpr (B == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < B; ++i) w[i] = __ldg(reinterpret_cast<const u32*>(p) + i);
  }
}

// Shared-memory layout of a float vector that lanes read in 32-element chunks (lane l: chunk l, l+32,
// ...): float4 granule g (0..7) of chunk c sits at granule 8c + ((g + c) & 7), so the 8 lanes of a
// quarter-warp read 8 different bank groups instead of all hitting the same one.
__device__ __forceinline__ i32 swizzle32(i32 k) {
  const i32 c = k >> 5, g = (k >> 2) & 7;
  return (c << 5) | (((g + c) & 7) << 2) | (k & 3);
}

// Block-wide copy of n elements of src (T, converted to float) into shared memory, laid out by
// swizzle32 when SWZ (then n % 8 == 0 and src is 8-element aligned: 16/32-byte vector loads). Four
// vectors per thread are loaded before any is stored, so the copy costs one memory latency, not one
// per element. Ends with __syncthreads().
template <int THREADS, bool SWZ, typename T>
__device__ __forceinline__ void stage_to_smem(float* __restrict__ dst, const T* __restrict__ src, i32 n) {
  if constexpr (SWZ) {
    constexpr int kBatch = 4;
    for (i32 g0 = threadIdx.x; g0 * 8 < n; g0 += kBatch * THREADS) {
      float v[kBatch][8];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const i32 g = g0 + u * THREADS;
        if (g * 8 < n) load8_f32<T, true>(src + (i64)g * 8, v[u]);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const i32 g = g0 + u * THREADS;
        if (g * 8 < n) {
          float4* d0 = reinterpret_cast<float4*>(dst + swizzle32(g * 8));
          float4* d1 = reinterpret_cast<float4*>(dst + swizzle32(g * 8 + 4));
          *d0 = make_float4(v[u][0], v[u][1], v[u][2], v[u][3]);
          *d1 = make_float4(v[u][4], v[u][5], v[u][6], v[u][7]);
        }
      }
    }
  } else {
    for (i32 i = threadIdx.x; i < n; i += THREADS) dst[i] = Traits<T>::to_float(src[i]);
  }
  __syncthreads();
}

// Float of code q minus the zero point: (2^23 + q) - (2^23 + zp), exact for integer zp (one FADD);
// a fractional zero_point_offset subtracts in two steps.
template <bool INT_ZP> __device__ __forceinline__ float code_minus_zp(u32 q, float zp) {
  const float f = __int_as_float(0x4B000000u | q);  // 2^23 + q
  if constexpr (INT_ZP) return f - (8388608.0f + zp);
  else return (f - 8388608.0f) - zp;
}

// sum_j (q_j - zp) x_j for codes j in [J0, J0 + N) of a chunk (unrolled: every shift is a constant).
template <int B, int J0, int N, bool INT_ZP>
__device__ __forceinline__ float chunk_dot(const u32 (&w)[B], const float (&xv)[32], float zp) {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = J0; j < J0 + N; ++j) {
    const int bit = j * B, word = bit >> 5, off = bit & 31;
    u32 q;
    if (off + B <= 32) q = (w[word] >> off) & ((1u << B) - 1u);
    else q = __funnelshift_r(w[word], w[word + 1 < B ? word + 1 : word], off) & ((1u << B) - 1u);
    a[j & 3] = fmaf(code_minus_zp<INT_ZP>(q, zp), xv[j], a[j & 3]);
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// out[r] = sum_k w[e, n[r], k] * x[k] for RW rows (every lane gets the sums). x: float, length qp.K,
// in shared memory: laid out by swizzle32 when VEC (x starting at chunk cbase of the staged vector),
// plainly otherwise.
template <int RW, bool VEC, class QP>
__device__ __forceinline__ void warp_dot_rows(const QP& qp, const u8* __restrict__ w, i32 e, const i32 (&n)[RW],
                                              const float* __restrict__ x, int lane, float (&out)[RW],
                                              i32 cbase = 0) {
  constexpr int B = QP::kBits;
  constexpr int BLK = QP::kBlock;
  constexpr bool kIntZp = QP::kZp != ZP_OFFSET;
  const i64 row_bytes = packed_bytes<B>(qp.K);
  const u8* rows[RW];
#pragma unroll
  for (int r = 0; r < RW; ++r) rows[r] = w + ((i64)e * qp.N + n[r]) * row_bytes;
  if constexpr (VEC) {
    const i32 chunks = qp.K >> 5;
    float acc[RW];
    ScaleZp rs[RW];  // row-wise: one scale / zero point per row
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      acc[r] = 0.0f;
      if constexpr (BLK == 0) rs[r] = qp.fetch(e, n[r], 0);
    }
    for (i32 c = lane; c < chunks; c += 32) {
      const i64 k0 = (i64)c << 5;
      u32 wq[RW][B];
#pragma unroll
      for (int r = 0; r < RW; ++r) load_chunk32<B>(rows[r] + (i64)c * (4 * B), wq[r]);
      float xv[32];
      const float4* xc = reinterpret_cast<const float4*>(x) + ((i64)c << 3);
#pragma unroll
      for (int g = 0; g < 8; ++g) {
        const float4 v = xc[(g + c + cbase) & 7];  // swizzle32 of the staged vector (x = its chunk cbase)
        xv[4 * g] = v.x; xv[4 * g + 1] = v.y; xv[4 * g + 2] = v.z; xv[4 * g + 3] = v.w;
      }
#pragma unroll
      for (int r = 0; r < RW; ++r) {
        if constexpr (BLK == 0) {
          acc[r] += chunk_dot<B, 0, 32, kIntZp>(wq[r], xv, rs[r].zp);
        } else if constexpr (BLK == 16) {
          const i32 blk = (i32)(k0 >> 4);
          const ScaleZp s0 = qp.fetch(e, n[r], blk), s1 = qp.fetch(e, n[r], blk + 1);
          acc[r] = fmaf(s0.scale, chunk_dot<B, 0, 16, kIntZp>(wq[r], xv, s0.zp), acc[r]);
          acc[r] = fmaf(s1.scale, chunk_dot<B, 16, 16, kIntZp>(wq[r], xv, s1.zp), acc[r]);
        } else {
          const ScaleZp s = qp.fetch(e, n[r], (i32)(k0 / BLK));
          acc[r] = fmaf(s.scale, chunk_dot<B, 0, 32, kIntZp>(wq[r], xv, s.zp), acc[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      out[r] = warp_sum(acc[r]);
      if constexpr (BLK == 0) out[r] *= rs[r].scale;
    }
  } else {
    // any K / alignment: groups of 8 codes, then the K % 8 tail
    const i32 groups = qp.K >> 3;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      float acc = 0.0f;
      ScaleZp sz = qp.fetch(e, n[r], 0);
      for (i32 g = lane; g < groups; g += 32) {
        const i64 k0 = (i64)g << 3;
        if constexpr (BLK != 0) sz = qp.fetch(e, n[r], (i32)(k0 / BLK));
        u32 q[8];
        load_unpack8<B, false>(rows[r], k0, q);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) part = fmaf((float)q[i] - sz.zp, x[k0 + i], part);
        acc = fmaf(part, sz.scale, acc);
      }
      for (i64 kk = ((i64)groups << 3) + lane; kk < qp.K; kk += 32) {
        if constexpr (BLK != 0) sz = qp.fetch(e, n[r], (i32)(kk / BLK));
        acc = fmaf(dequant1(code_at<B>(rows[r], kk), sz), x[kk], acc);
      }
      out[r] = warp_sum(acc);
    }
  }
}

}  // namespace qmoe
