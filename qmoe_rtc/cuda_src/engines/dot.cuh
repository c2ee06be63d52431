// engines/dot.cuh: the inner step of the decode path — one K item of RW packed weight rows of one expert
// against one activation vector, accumulated in float32.
//
// VEC (K % 32 == 0, rows 16-byte aligned): an item is a chunk of 32 codes (4*b bytes: one 16-byte
// load for 4-bit, two for 8-bit, 8/4/12 bytes for 2/1/3-bit) and the matching 32 activations, read
// straight from global memory (L1/L2-resident). Codes become floats exactly through the 2^23
// mantissa trick, the zero point is subtracted exactly (FP8: e4m3_to_float, no zero point), the
// scale is applied per block.
// !VEC: an item is a group of 8 codes (any K: the last group may be partial), read byte-wise.
#pragma once

#include "core/dequant.cuh"
#include "core/types.cuh"
#include "core/unpack.cuh"

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

// Float of code q minus the zero point: (2^23 + q) - (2^23 + zp), exact for integer zp (one FADD);
// a fractional zero_point_offset subtracts in two steps; FP8 / FP4 codes are e4m3 / e2m1 values (no zero point).
template <int ZP> __device__ __forceinline__ float code_minus_zp(u32 q, float zp) {
  const float f = __int_as_float(0x4B000000u | q);  // 2^23 + q
  if constexpr (ZP == ZP_FP8) return e4m3_to_float(q);
  else if constexpr (ZP == ZP_FP4) return e2m1_to_float(q);
  else if constexpr (ZP != ZP_OFFSET) return f - (8388608.0f + zp);
  else return (f - 8388608.0f) - zp;
}

// sum_j (q_j - zp) x_j for codes j in [J0, J0 + N) of a chunk (unrolled: every shift is a constant).
template <int B, int J0, int N, int ZP>
__device__ __forceinline__ float chunk_dot(const u32 (&w)[B], const float (&xv)[32], float zp) {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int j = J0; j < J0 + N; ++j) {
    const int bit = j * B, word = bit >> 5, off = bit & 31;
    u32 q;
    if (off + B <= 32) q = (w[word] >> off) & ((1u << B) - 1u);
    else q = __funnelshift_r(w[word], w[word + 1 < B ? word + 1 : word], off) & ((1u << B) - 1u);
    a[j & 3] = fmaf(code_minus_zp<ZP>(q, zp), xv[j], a[j & 3]);
  }
  return (a[0] + a[1]) + (a[2] + a[3]);
}

// acc[r] += wt * sum over item `it` of w[e, n[r], k] * x[k].
//   VEC: item = codes [32 it, 32 it + 32); !VEC: item = codes [8 it, min(8 it + 8, K)).
template <int RW, bool VEC, class QP, typename XT>
__device__ __forceinline__ void accum_item(const QP& qp, const u8* __restrict__ w, i32 e, const i32 (&n)[RW],
                                           const XT* __restrict__ x, i32 it, float wt, float (&acc)[RW]) {
  constexpr int B = QP::kBits;
  constexpr int BLK = QP::kBlock;
  constexpr int kZp = QP::kZp;
  const i64 row_bytes = packed_bytes<B>(qp.K);
  if constexpr (VEC) {
    const i64 k0 = (i64)it << 5;
    u32 wq[RW][B];
#pragma unroll
    for (int r = 0; r < RW; ++r) load_chunk32<B>(w + ((i64)e * qp.N + n[r]) * row_bytes + (i64)it * (4 * B), wq[r]);
    float xv[32];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      float v8[8];
      load8_f32<XT, true>(x + k0 + 8 * g, v8);
#pragma unroll
      for (int i = 0; i < 8; ++i) xv[8 * g + i] = v8[i];
    }
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      if constexpr (BLK == 16) {
        const ScaleZp s0 = qp.fetch(e, n[r], (i32)(k0 >> 4)), s1 = qp.fetch(e, n[r], (i32)(k0 >> 4) + 1);
        const float d = s0.scale * chunk_dot<B, 0, 16, kZp>(wq[r], xv, s0.zp) +
                        s1.scale * chunk_dot<B, 16, 16, kZp>(wq[r], xv, s1.zp);
        acc[r] = fmaf(wt, d, acc[r]);
      } else {
        const ScaleZp s = qp.fetch(e, n[r], QP::block_of(k0));
        acc[r] = fmaf(wt * s.scale, chunk_dot<B, 0, 32, kZp>(wq[r], xv, s.zp), acc[r]);
      }
    }
  } else {
    const i64 k0 = (i64)it << 3;
#pragma unroll
    for (int r = 0; r < RW; ++r) {
      const u8* row = w + ((i64)e * qp.N + n[r]) * row_bytes;
      float d = 0.0f;
      if (k0 + 8 <= qp.K) {  // a whole group: inside one scale block (block sizes are multiples of 16)
        const ScaleZp s = qp.fetch(e, n[r], QP::block_of(k0));
        u32 q[8];
        load_unpack8<B, false>(row, k0, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(QP::weight(q[i], s), Traits<XT>::to_float(x[k0 + i]), d);
      } else {
        for (i64 kk = k0; kk < k0 + 8 && kk < qp.K; ++kk)
          d = fmaf(QP::weight(code_at<B>(row, kk), qp.fetch(e, n[r], QP::block_of(kk))), Traits<XT>::to_float(x[kk]), d);
      }
      acc[r] = fmaf(wt, d, acc[r]);
    }
  }
}

// Items of a K-long row: 32-code chunks (VEC) or 8-code groups.
template <bool VEC> __device__ __forceinline__ i32 items_of(i32 K) { return VEC ? (K >> 5) : ((K + 7) >> 3); }

// Sums of v[0..N) over the block (THREADS threads), the same in every thread, in a fixed order
// (deterministic): warp shuffles, then the warps' partial sums in warp order, all N values through
// one pair of barriers. smem: THREADS/32 * N floats.
template <int THREADS, int N> __device__ __forceinline__ void block_sums_fixed(float (&v)[N], float* smem) {
  constexpr int kWarps = THREADS / 32;
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v[j] += __shfl_xor_sync(0xffffffffu, v[j], o);
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int j = 0; j < N; ++j) smem[(threadIdx.x >> 5) * N + j] = v[j];
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += smem[w * N + j];
    v[j] = t;
  }
}

}  // namespace qmoe
