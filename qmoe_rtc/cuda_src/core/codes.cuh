// core/codes.cuh: where a tensor-core lane finds its 32 codes of a weight row -- in the contract layout
// (row-major packed rows, as ONNX Runtime stores them) or in the tiled layout the layer prepacks at
// upload for the tensor-core engines (QMOE_TILED; host side and its inverse: qmoe_rtc/tiled/transform.py).
//
// A segment is 32 consecutive codes of a row (4·B bytes); segment s = 4c + t is lane t's share of the
// 128-code chunk c.
//   contract  w [E, N, K·B/8] u8             row n, segment s at (e·N + n)·K·B/8 + 4·B·s
//   tiled     w [E, N8, NCH, 8, 4, 4·B] u8    N8 = ceil(N / 8) row groups, NCH = ceil(K / 128) chunks,
//                                            padding rows / codes zero; tile row m, segment 4c + t at
//                                            ((e·N8 + m / 8)·NCH + c)·128·B + ((m % 8)·4 + t)·4·B
// so the lanes (g, t) of a warp that read tile rows 8q + g of chunk c read 128·B contiguous bytes,
// and a row group's K is one contiguous run. Inside a tiled segment the codes are in pair order: the
// stored positions a dequantized pair comes from (MmaDeq::first_code(i), + kPairsPerWord) hold natural
// codes 2i and 2i + 1, so a pair's activations are one word of x (MmaDeq::low_code, x_pair).
// Tile rows: every projection keeps its row order except FC1 with interleaved gate / linear rows
// (epilogue/fc1.cuh Fc1Rows::tile_row).
#pragma once

#include "core/types.cuh"
#include "core/unpack.cuh"

#ifndef QMOE_TILED
#define QMOE_TILED 0
#endif

namespace qmoe {

inline constexpr bool kTiled = QMOE_TILED;

template <int B> struct CodeRows {
  // Byte offset of tile row m's segment 0 in expert e of a projection with N rows of K codes.
  static __device__ __forceinline__ i64 row(i32 e, i32 N, i32 m, i32 K) {
    if constexpr (kTiled) {
      return (((i64)e * ((N + 7) >> 3) + (m >> 3)) * ((K + 127) >> 7)) * (128 * B) + (m & 7) * (16 * B);
    } else {
      return ((i64)e * N + m) * packed_bytes<B>(K);
    }
  }
  // Byte offset of chunk c's segment 4c + t from the row's segment t: c·(a chunk's bytes of one row) in both
  // layouts (4c + t is the segment seg() places, for 0 <= t < 4).
  static constexpr int kChunkBytes = kTiled ? 128 * B : 16 * B;
  // Byte offset of segment s from the row's segment 0.
  static __device__ __forceinline__ i64 seg(i32 s) {
    if constexpr (kTiled) return (i64)(s >> 2) * (128 * B) + (s & 3) * (4 * B);
    else return (i64)s * (4 * B);
  }
};

}  // namespace qmoe
