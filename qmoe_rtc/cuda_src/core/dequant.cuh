// core/dequant.cuh: scales, zero points and the dequantization formula of one projection.
//
//   w = (q - zp) * scale      (float32; docs/contract.md, "Packed weights and dequantization")
//
// Compile-time layout: BITS (1/2/3/4/8), BLOCK (0 = row-wise, else a power of two >= 16 dividing K)
// and ZP (zero-point mode below). The scale storage type ScaleT is float or the activation type.
#pragma once

#include "core/types.cuh"
#include "core/unpack.cuh"

namespace qmoe {

// Zero-point mode of a projection (mirrors qmoe_rtc.specialize.ZP_MODES).
enum ZpMode : int {
  ZP_NONE = 0,    // no zero-point tensor: zp = 2^(b-1) (offset-binary storage)
  ZP_PACKED = 1,  // uint8 zero-point tensor packed like the weights (8-bit: one byte each)
  ZP_OFFSET = 2,  // no tensor, zp = the runtime float zero_point_offset [ext]
};

struct ScaleZp {
  float scale;
  float zp;
};

// Per-(row, block) scale and zero point of one projection of all experts.
//   scales: [E, N] (BLOCK == 0) or [E, N, nb], nb = K / BLOCK
//   zp (ZP_PACKED): [E, ceil(N*b/8)] packed along N (BLOCK == 0)
//                   [E, N, ceil(nb*b/8)] packed along the block axis (BLOCK > 0)
template <typename ScaleT, int BITS, int BLOCK, int ZP> struct QuantParams {
  static_assert(BLOCK == 0 || (BLOCK >= 8 && (BLOCK & (BLOCK - 1)) == 0), "block size must be 0 or a power of two >= 8");
  static_assert(ZP == ZP_NONE || ZP == ZP_PACKED || ZP == ZP_OFFSET, "bad zero-point mode");
  static constexpr int kBits = BITS;
  static constexpr int kBlock = BLOCK;
  static constexpr int kZp = ZP;
  using Scale = ScaleT;

  const ScaleT* __restrict__ scales;
  const u8* __restrict__ zp;  // only read when ZP == ZP_PACKED
  float zp_offset;            // only read when ZP == ZP_OFFSET
  i32 N;                      // rows per expert
  i32 K;                      // codes per row

  __device__ __forceinline__ i32 blocks_per_row() const { return BLOCK ? K / BLOCK : 1; }

  // Index of the block holding element k (0 for row-wise).
  static __device__ __forceinline__ i32 block_of(i64 k) { return BLOCK ? (i32)(k / BLOCK) : 0; }

  // Scale and zero point of expert e, row n, block j (j = 0 for row-wise).
  __device__ __forceinline__ ScaleZp fetch(i32 e, i32 n, i32 j) const {
    const i64 row = (i64)e * N + n;
    const i32 nb = blocks_per_row();
    ScaleZp r;
    r.scale = Traits<ScaleT>::to_float(scales[row * nb + j]);
    if constexpr (ZP == ZP_NONE) {
      r.zp = (float)(1u << (BITS - 1));
    } else if constexpr (ZP == ZP_OFFSET) {
      r.zp = zp_offset;
    } else if constexpr (BLOCK == 0) {
      r.zp = (float)code_at<BITS>(zp + (i64)e * packed_bytes<BITS>(N), n);
    } else {
      r.zp = (float)code_at<BITS>(zp + row * packed_bytes<BITS>(nb), j);
    }
    return r;
  }

  // Where fetch() reads the zero point, for kernels that copy the bytes themselves (cp.async) and
  // decode later (BITS 1/2/4/8: a zero-point code never straddles a byte).
  __device__ __forceinline__ i64 zp_byte(i32 e, i32 n, i32 j) const {
    static_assert(8 % BITS == 0, "zp_byte: 1/2/4/8-bit codes only");
    if constexpr (BLOCK == 0) return (i64)e * packed_bytes<BITS>(N) + (i64)n * BITS / 8;
    else return ((i64)e * N + n) * packed_bytes<BITS>(blocks_per_row()) + (i64)j * BITS / 8;
  }
  // zero point from the byte zp_byte(e, n, j) points at
  static __device__ __forceinline__ float zp_from_byte(u32 byte, i32 n, i32 j) {
    return (float)((byte >> (((BLOCK == 0 ? n : j) * BITS) & 7)) & ((1u << BITS) - 1u));
  }
};

// One weight in float32.
__device__ __forceinline__ float dequant1(u32 q, ScaleZp sz) {
  return ((float)q - sz.zp) * sz.scale;
}

// Eight codes (from unpack8 / load_unpack8) to float32 weights.
__device__ __forceinline__ void dequant8(const u32 (&q)[8], ScaleZp sz, float (&w)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = dequant1(q[i], sz);
}

}  // namespace qmoe
