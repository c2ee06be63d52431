// core/lane_meta.cuh: the scale(s) and zero point of one lane's 32 codes of a weight row, copied into
// shared memory as the aligned 4-byte words that hold them (cp.async) and decoded at compute time.
// Shared by the tensor-core engines, whose lanes each own a row segment of 32 codes.
//
//   meta words of a lane: [kWords][32 lanes] u32, 128 bytes apart
//     scale word(s): float32 scales: kSW words (two when a 32-code segment spans two blocks of 16);
//                    16-bit scales: the aligned word holding the scale (both, with blocks of 16)
//     zp word (ZPW): the aligned word holding the zero-point byte (packed zero points only); 3-bit
//                    codes: the aligned word holding the zero point's first bit and the next one
//                    (copied only when the zero point straddles into it)
// A word may reach up to 3 bytes past a tensor's last element, inside the same allocation granule
// (CuPy / torch allocate in 512-byte units); those bytes are never used.
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
  static constexpr int kWords = kSW + kZW;
};

template <class QP, bool ZPW> struct LaneMeta {
  using ScaleT = typename QP::Scale;
  using L = MetaLayout<ScaleT, QP::kBlock, ZPW, QP::kBits>;

  // Copy the words of expert e, row n, block j to the lane's `meta` (shared address of its word 0);
  // `live` false zero-fills. `sbase`: qp.scale_index(e, n, 0) (the scale of block j is at sbase + j),
  // computed once per lane row by the caller. `dummy`: any valid global address.
  static __device__ __forceinline__ void issue(const QP& qp, i64 sbase, i32 e, i32 n, i32 j, u32 meta, bool live,
                                               const void* dummy) {
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

  // Scale and zero point of block j0 + h (h < NSB) from the lane's words (`meta`: its word 0).
  static __device__ __forceinline__ ScaleZp decode(const QP& qp, const u32* meta, i64 sbase, i32 e, i32 n, i32 j0,
                                                   int h) {
    const i32 j = j0 + h;
    ScaleZp sz;
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
