// core/dequant.cuh: scales, zero points and the dequantization formula of one projection.
//
//   w = (q - zp) * scale      (float32; docs/contract.md, "Packed weights and dequantization")
//   w = e4m3(q) * scale       (ZP_FP8: float8 e4m3fn codes; docs/contract.md, "FP8 experts")
//   w = e2m1(q) * scale       (ZP_FP4: 4-bit e2m1 codes, float32 block scales; "FP4 experts [ext]")
//
// Compile-time layout: BITS (1/2/3/4/8), BLOCK (0 = row-wise, else a power of two >= 16 dividing K;
// FP8: 0 = one scale per expert, else square blocks, the last ones partial) and ZP (decode trait
// below). The scale storage type ScaleT is float or the activation type. Where a scale lives is
// QuantParams::scale_index (contract layout) or QuantParams::meta_record (tiled meta), the places every
// engine reads it from.
#pragma once

#include "core/types.cuh"
#include "core/unpack.cuh"

#ifndef QMOE_TILED_META
#define QMOE_TILED_META 0
#endif

namespace qmoe {

// Scales and zero points in the tiled meta layout (qmoe_rtc/tiled/transform.py pack_meta; integer codes in the
// tiled layout only): one record per (16-row tile, scale block, lane row pair) holding both rows'
// scales and zero points, so a tensor-core lane copies its rows' coefficients of a block at once.
inline constexpr bool kTiledMetaLayout = QMOE_TILED_META;

// Decode trait of a projection: its format and zero-point mode as one (mirrors qmoe_rtc.specialize.CPP_ZP).
enum ZpMode : int {
  ZP_NONE = 0,    // no zero-point tensor: zp = 2^(b-1) (offset-binary storage)
  ZP_PACKED = 1,  // uint8 zero-point tensor packed like the weights (8-bit: one byte each)
  ZP_OFFSET = 2,  // no tensor, zp = the runtime float zero_point_offset [ext]
  ZP_FP8 = 3,     // 8-bit float8 e4m3fn codes, no zero point: w = e4m3(q) * scale
  ZP_FP4 = 4,     // 4-bit e2m1 codes, no zero point: w = e2m1(q) * scale (MXFP4 / NVFP4 [ext])
};

// The float32 value of an e4m3fn code (bits 0-7 of c): sign bit 7, exponent bits 6-3 (bias 7),
// mantissa bits 2-0; exponent 0 is subnormal (m/8 * 2^-6), 0x7F / 0xFF are NaN, no infinities.
// Exact, built from integer fields (no subnormal float32 is ever formed, so -ftz cannot change it).
__device__ __forceinline__ float e4m3_to_float(u32 c) {
  const u32 em = c & 0x7Fu;                                             // exponent and mantissa
  const float v = (em >> 3) ? __uint_as_float((em << 20) + (120u << 23))  // (1 + m/8) * 2^(e-7)
                            : (float)(c & 7u) * 0.001953125f;             // m * 2^-9
  const u32 bits = em == 0x7Fu ? 0x7FC00000u : __float_as_uint(v);
  return __uint_as_float(bits | ((c & 0x80u) << 24));
}

// The float32 value of an e2m1 code (bits 0-3 of c): sign bit 3, exponent bits 2-1 (bias 1), mantissa
// bit 0; exponent 0 is subnormal (m/2). Magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; exact.
__device__ __forceinline__ float e2m1_to_float(u32 c) {
  const u32 em = c & 7u;
  const float v = (em >> 1) ? __uint_as_float(((em + 252u) << 22))  // (1 + m/2) * 2^(e-1)
                            : (float)(em & 1u) * 0.5f;              // m/2
  return __uint_as_float(__float_as_uint(v) | ((c & 8u) << 28));
}

struct ScaleZp {
  float scale;
  float zp;
};

// Per-(row, block) scale and zero point of one projection of all experts.
//   scales: [E, N] (BLOCK == 0) or [E, N, nb], nb = K / BLOCK
//           ZP_FP8: [E] (BLOCK == 0) or [E, ceil(N/BLOCK), nb], nb = ceil(K/BLOCK) (square blocks)
//   zp (ZP_PACKED): [E, ceil(N*b/8)] packed along N (BLOCK == 0)
//                   [E, N, ceil(nb*b/8)] packed along the block axis (BLOCK > 0)
// Tiled meta (kTiledMeta; `scales` points at the records, `zp` is not read):
//   meta [E, ceil(N/16), nb, 8, kMetaBytes] u8   record (e, q, j, g): block j of tile rows 16q + g and
//        16q + 8 + g (core/codes.cuh tile rows): scale of each (ScaleT [2]), then with ZP_PACKED their
//        zero points (u8 [2], unpacked), zero padding to kMetaBytes; rows past N are zero
template <typename ScaleT, int BITS, int BLOCK, int ZP> struct QuantParams {
  static_assert(BLOCK == 0 || (BLOCK >= 8 && (BLOCK & (BLOCK - 1)) == 0), "block size must be 0 or a power of two >= 8");
  static_assert(ZP == ZP_NONE || ZP == ZP_PACKED || ZP == ZP_OFFSET || ZP == ZP_FP8 || ZP == ZP_FP4,
                "bad zero-point mode");
  static_assert(ZP != ZP_FP8 || BITS == 8, "FP8 codes are 8-bit");
  static_assert(ZP != ZP_FP4 || BITS == 4, "FP4 codes are 4-bit");
  static constexpr int kBits = BITS;
  static constexpr int kBlock = BLOCK;
  // K is a whole number of 128-code chunks: a block of 128 or more divides K (FP8's last blocks may be partial)
  static constexpr bool kWholeChunks = BLOCK >= 128 && ZP != ZP_FP8;
  static constexpr int kZp = ZP;
  using Scale = ScaleT;
  static constexpr bool kTiledMeta = kTiledMetaLayout && (ZP == ZP_NONE || ZP == ZP_PACKED || ZP == ZP_FP4);
  static_assert(!kTiledMetaLayout || kTiledMeta, "the host defines QMOE_TILED_META for integer and FP4 codes only");
  // bytes of a tiled meta record (the host mirrors it: qmoe_rtc/tiled/transform.py meta_record_bytes)
  static constexpr int kMetaBytes = ZP == ZP_PACKED ? (sizeof(ScaleT) == 4 ? 16 : 8) : 2 * (int)sizeof(ScaleT);

  const ScaleT* __restrict__ scales;
  const u8* __restrict__ zp;  // only read when ZP == ZP_PACKED (contract layout)
  float zp_offset;            // only read when ZP == ZP_OFFSET
  i32 N;                      // rows per expert
  i32 K;                      // codes per row
  bool il = false;            // FC1 with interleaved gate / linear rows: tile rows differ from rows

  // Scale blocks along K (1 for row-wise / per-expert scales; FP8 blocks may be partial).
  __device__ __forceinline__ i32 blocks_per_row() const {
    if constexpr (BLOCK == 0) return 1;
    else return ZP == ZP_FP8 ? (K + BLOCK - 1) / BLOCK : K / BLOCK;
  }

  // Index of the block holding element k (0 for row-wise).
  static __device__ __forceinline__ i32 block_of(i64 k) { return BLOCK ? (i32)(k / BLOCK) : 0; }
  // The same for 0 <= k < 2^31 (a shift: no sign fix-up)
  static __device__ __forceinline__ i32 block_of_u(i32 k) { return BLOCK ? (i32)((u32)k / (u32)(BLOCK ? BLOCK : 1)) : 0; }

  // Tile row of row n (core/codes.cuh; epilogue/fc1.cuh Fc1Rows::tile_row for interleaved FC1 rows).
  __device__ __forceinline__ i32 tile_row(i32 n) const {
    return il ? ((n >> 4) << 4) + ((n & 1) << 3) + ((n >> 1) & 7) : n;
  }
  // Tiled meta: byte offset of the record holding row n's block j (block j + 1's is kMetaBlockStride on),
  // and which of its two rows n is.
  static constexpr i64 kMetaBlockStride = 8 * kMetaBytes;
  __device__ __forceinline__ i64 meta_record(i32 e, i32 n, i32 j) const {
    const i32 m = tile_row(n);
    return meta_group(e, m, j) + (m & 7) * kMetaBytes;
  }
  // The 8 records of block j of the 16-row tile holding tile row m (blocks j, j + 1 .. follow).
  __device__ __forceinline__ i64 meta_group(i32 e, i32 m, i32 j) const {
    return (((i64)e * ((N + 15) >> 4) + (m >> 4)) * blocks_per_row() + j) * kMetaBlockStride;
  }
  __device__ __forceinline__ int meta_half(i32 n) const { return (tile_row(n) >> 3) & 1; }

  // Where the scale of expert e, row n, block j lives in `scales` (linear in j: blocks j, j + 1 of a
  // row are neighbours). Every engine addresses scales through this (contract layout).
  __device__ __forceinline__ i64 scale_index(i32 e, i32 n, i32 j) const {
    if constexpr (ZP == ZP_FP8 && BLOCK == 0) return e;  // one scale per expert
    else if constexpr (ZP == ZP_FP8) return ((i64)e * ((N + BLOCK - 1) / BLOCK) + n / BLOCK) * blocks_per_row() + j;
    else return ((i64)e * N + n) * blocks_per_row() + j;
  }

  // The zero point when it is not read from a tensor (ZP_NONE, ZP_OFFSET, ZP_FP8, ZP_FP4).
  __device__ __forceinline__ float fixed_zp() const {
    if constexpr (ZP == ZP_OFFSET) return zp_offset;
    else if constexpr (ZP == ZP_FP8 || ZP == ZP_FP4) return 0.0f;
    else return (float)(1u << (BITS - 1));
  }

  // Scale and zero point of expert e, row n, block j (j = 0 for row-wise).
  __device__ __forceinline__ ScaleZp fetch(i32 e, i32 n, i32 j) const {
    ScaleZp r;
    if constexpr (kTiledMeta) {
      const u8* rec = reinterpret_cast<const u8*>(scales) + meta_record(e, n, j);
      const int h = meta_half(n);
      r.scale = Traits<ScaleT>::to_float(reinterpret_cast<const ScaleT*>(rec)[h]);
      r.zp = ZP == ZP_PACKED ? (float)rec[2 * sizeof(ScaleT) + h] : fixed_zp();
    } else {
      r.scale = Traits<ScaleT>::to_float(scales[scale_index(e, n, j)]);
      if constexpr (ZP != ZP_PACKED) {
        r.zp = fixed_zp();
      } else if constexpr (BLOCK == 0) {
        r.zp = (float)code_at<BITS>(zp + (i64)e * packed_bytes<BITS>(N), n);
      } else {
        r.zp = (float)code_at<BITS>(zp + ((i64)e * N + n) * packed_bytes<BITS>(blocks_per_row()), j);
      }
    }
    return r;
  }

  // One weight in float32 from its code: (q - zp) * scale, e4m3(q) * scale or e2m1(q) * scale.
  static __device__ __forceinline__ float weight(u32 q, ScaleZp sz) {
    if constexpr (ZP == ZP_FP8) return e4m3_to_float(q) * sz.scale;
    else if constexpr (ZP == ZP_FP4) return e2m1_to_float(q) * sz.scale;
    else return ((float)q - sz.zp) * sz.scale;
  }
  // Eight codes (from unpack8 / load_unpack8) to float32 weights.
  static __device__ __forceinline__ void weights8(const u32 (&q)[8], ScaleZp sz, float (&w)[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = weight(q[i], sz);
  }

  // Bit index in `zp` of the zero point of expert e, row n, block j (any width; a 3-bit zero point
  // may straddle bytes and 32-bit words).
  __device__ __forceinline__ i64 zp_bit(i32 e, i32 n, i32 j) const {
    if constexpr (BLOCK == 0) return (i64)e * packed_bytes<BITS>(N) * 8 + (i64)n * BITS;
    else return ((i64)e * N + n) * packed_bytes<BITS>(blocks_per_row()) * 8 + (i64)j * BITS;
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

}  // namespace qmoe
