// core/lane_meta.cuh: the scale(s) and zero point of one lane's 32 codes of a weight row, copied into
// shared memory (cp.async) and decoded at compute time. Shared by the tensor-core engines, whose lanes
// each own a row segment of 32 codes.
//
// Contract layout -- the aligned 4-byte words that hold them:
//   meta words of a row: [kWords][32 lanes] u32, 128 bytes apart
//     scale word(s): float32 scales: kSW words (two when a 32-code segment spans two blocks of 16);
//                    16-bit scales: the aligned word holding the scale (both, with blocks of 16)
//     zp word (ZPW): the aligned word holding the zero-point byte (packed zero points only); 3-bit
//                    codes: the aligned word holding the zero point's first bit and the next one
//                    (copied only when the zero point straddles into it)
//   A word may reach up to 3 bytes past a tensor's last element, inside the same allocation granule
//   (CuPy / torch allocate in 512-byte units); those bytes are never used.
// Tiled meta (core/dequant.cuh kTiledMetaLayout) -- the records that hold them, one per block:
//   meta of a row: [32 lanes][NSB][kRec bytes]  record h: block j + h of the lane's row pair (the
//                  record's half for this row is decoded); kRec = the larger record of the two rows'
//                  projections, so both rows of a lane share one slot size
#pragma once

#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/types.cuh"

namespace qmoe {

// The host mirrors kWords (kernels/_expert.py meta_words; a compiled check compares them).
template <typename ScaleT, int BLOCK, bool ZPW, int BITS = 4> struct MetaLayout {
  static constexpr int NSB = BLOCK == 16 ? 2 : 1;                        // scale blocks per 32 codes
  static constexpr int kSW = (NSB == 2 && sizeof(ScaleT) == 4) ? 2 : 1;  // scale words
  static constexpr int kZW = ZPW ? (BITS == 3 ? 2 : 1) : 0;              // zero-point words
  // tiled meta: bytes of the record slot (QuantParams::kMetaBytes of a packed / no zero point)
  static constexpr int kRec = ZPW ? (sizeof(ScaleT) == 4 ? 16 : 8) : 2 * (int)sizeof(ScaleT);
  static constexpr int kWords = kTiledMetaLayout ? NSB * kRec / 4 : kSW + kZW;
};

template <class QP, bool ZPW> struct LaneMeta {
  using ScaleT = typename QP::Scale;
  using L = MetaLayout<ScaleT, QP::kBlock, ZPW, QP::kBits>;
  static constexpr bool kT = QP::kTiledMeta;
  static_assert(kT == kTiledMetaLayout, "a tensor-core stage holds one meta layout");

  // Where row n's block 0 lives (scale index, or tiled meta: byte offset of its record), computed
  // once per lane row by the caller and passed to issue / decode as `sbase`.
  static __device__ __forceinline__ i64 base(const QP& qp, i32 e, i32 n) {
    if constexpr (kT) return qp.meta_record(e, n, 0);
    else return qp.scale_index(e, n, 0);
  }
  // Byte offset of the lane's word 0 in a row's meta (the callers' shared layout above).
  static __device__ __forceinline__ u32 lane_bytes(i32 lane) { return (u32)lane * (kT ? 4 * L::kWords : 4); }

  // Copy the words of expert e, row n, block j to the lane's `meta` (shared address of its word 0);
  // `live` false zero-fills. `sbase`: base(qp, e, n). `dummy`: any valid global address.
  static __device__ __forceinline__ void issue(const QP& qp, i64 sbase, i32 e, i32 n, i32 j, u32 meta, bool live,
                                               const void* dummy) {
    if constexpr (kT) {
      const u8* rec = reinterpret_cast<const u8*>(qp.scales) + sbase + (i64)j * QP::kMetaBlockStride;
#pragma unroll
      for (int h = 0; h < L::NSB; ++h) cp_async(meta + h * L::kRec, rec + h * QP::kMetaBlockStride, QP::kMetaBytes, live);
      return;
    }
    const i64 si = sbase + j;
    if constexpr (sizeof(ScaleT) == 4) {
#pragma unroll
      for (int w = 0; w < L::kSW; ++w) cp_async(meta + w * 128, qp.scales + si + w, 4, live);
    } else {
      cp_async(meta, qp.scales + (si & ~1ll), 4, live);
    }
    if constexpr (ZPW && QP::kBits == 3 && QP::kZp == ZP_PACKED) {
      const i64 zb = qp.zp_bit(e, n, j);  // block j's zero point; with blocks of 16 block j + 1's follows
      const u8* w0 = qp.zp + ((zb >> 3) & ~3ll);
      const bool straddles = (zb & 31) + 3 * L::NSB > 32;  // the last bit needed is in the next word
      cp_async(meta + L::kSW * 128, w0, 4, live);
      cp_async(meta + (L::kSW + 1) * 128, straddles ? static_cast<const void*>(w0 + 4) : dummy, 4, live && straddles);
    } else if constexpr (ZPW && QP::kZp == ZP_PACKED) {
      cp_async(meta + L::kSW * 128, qp.zp + (qp.zp_byte(e, n, j) & ~3ll), 4, live);
    } else if constexpr (ZPW) {  // the other row's projection has packed zero points, this one not
      cp_async(meta + L::kSW * 128, dummy, 4, false);
    }
  }

  // The 16-bit scale of block j0 + h in both halves of a word (T2's splat when ScaleT is T: one byte
  // permute instead of a float round trip); the word and half decode() reads it from.
  static __device__ __forceinline__ u32 scale_splat(const QP& qp, const u32* meta, i64 sbase, i32 n, i32 j0, int h) {
    static_assert(sizeof(ScaleT) == 2, "scale_splat: 16-bit scales");
    const u32 w = kT ? meta[h * (L::kRec / 4)] : meta[0];
    const u32 half = kT ? (u32)qp.meta_half(n) : (u32)((sbase + j0 + h) & 1);
    return __byte_perm(w, 0u, 0x1010u + 0x2222u * half);
  }

  // Scale and zero point of block j0 + h (h < NSB) from the lane's words (`meta`: its word 0).
  static __device__ __forceinline__ ScaleZp decode(const QP& qp, const u32* meta, i64 sbase, i32 e, i32 n, i32 j0,
                                                   int h) {
    const i32 j = j0 + h;
    ScaleZp sz;
    if constexpr (kT) {
      const u32* w = meta + h * (L::kRec / 4);
      const int half = qp.meta_half(n);
      if constexpr (sizeof(ScaleT) == 4) {
        sz.scale = __uint_as_float(w[half]);
      } else {
        ScaleT v;
        *reinterpret_cast<u16*>(&v) = (u16)(w[0] >> (16 * half));
        sz.scale = Traits<ScaleT>::to_float(v);
      }
      if constexpr (QP::kZp == ZP_PACKED) sz.zp = (float)((w[sizeof(ScaleT) / 2] >> (8 * half)) & 0xffu);
      else sz.zp = qp.fixed_zp();
      return sz;
    }
    if constexpr (sizeof(ScaleT) == 4) {
      sz.scale = __uint_as_float(meta[(L::kSW == 2 ? h : 0) * 32]);
    } else {
      const u16 bits = (u16)(meta[0] >> (16 * ((sbase + j) & 1)));
      ScaleT v;
      *reinterpret_cast<u16*>(&v) = bits;
      sz.scale = Traits<ScaleT>::to_float(v);
    }
    if constexpr (QP::kZp == ZP_PACKED && QP::kBits == 3) {
      static_assert(ZPW, "packed zero points need the zp words");
      // block j0 + h's 3 bits, counted from bit 0 of the staged word holding block j0's first bit
      const u32 sh = (u32)(qp.zp_bit(e, n, j0) & 31) + 3u * (u32)h;
      const u64 words = ((u64)meta[(L::kSW + 1) * 32] << 32) | meta[L::kSW * 32];
      sz.zp = (float)((u32)(words >> sh) & 7u);
    } else if constexpr (QP::kZp == ZP_PACKED) {
      static_assert(ZPW, "packed zero points need the zp word");
      const i64 zb = qp.zp_byte(e, n, j);
      sz.zp = QP::zp_from_byte((meta[L::kSW * 32] >> (8 * (zb & 3))) & 0xffu, n, j);
    } else {
      sz.zp = qp.fixed_zp();  // 2^(b-1), the zero_point_offset, or 0 for FP8
    }
    return sz;
  }
};

}  // namespace qmoe
