// engines/dequant_expert.cuh: kernel family "dequant": packed experts -> dense weights.
//
//   w      [E, N, ceil(K*b/8)] uint8   codes, LSB-first along K (ZP_FP8: [E, N, K] e4m3fn codes)
//   scales [E, N] or [E, N, K/BLOCK]   ScaleT (ZP_FP8: [E] or [E, ceil(N/BLOCK), ceil(K/BLOCK)])
//   zp     see QuantParams (ZP_PACKED only; may be null otherwise)
//   out    [E, N, K] T                 out = (q - zp) * scale (ZP_FP8: e4m3(q) * scale), rounded once to T
//
// One thread per group of 8 consecutive codes of a row (a group never straddles a block because
// BLOCK is a multiple of 8); the partial last group of a row (K % 8 != 0) is read code by code.
// Grid-stride loop over E*N*ceil(K/8) groups.
#pragma once

#include "core/dequant.cuh"
#include "core/types.cuh"
#include "core/unpack.cuh"

namespace qmoe {

template <typename T, typename ScaleT, int BITS, int BLOCK, int ZP>
__global__ void dequant_expert(const u8* __restrict__ w, const ScaleT* __restrict__ scales,
                               const u8* __restrict__ zp, float zp_offset, T* __restrict__ out,
                               i32 E, i32 N, i32 K) {
  const QuantParams<ScaleT, BITS, BLOCK, ZP> qp{scales, zp, zp_offset, N, K};
  const i64 groups_per_row = (K + 7) / 8;
  const i64 total = (i64)E * N * groups_per_row;
  const i64 pitch = packed_bytes<BITS>(K);  // bytes per packed row
  // Whole-group loads/stores need every group start aligned: true when K % 8 == 0 and the bases are.
  const bool vec = (K % 8 == 0) && is_aligned(w, 8) && is_aligned(out, 8 * sizeof(T));

  for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < total; g += (i64)gridDim.x * blockDim.x) {
    const i64 row = g / groups_per_row;
    const i64 k0 = (g - row * groups_per_row) * 8;
    const i32 e = (i32)(row / N);
    const i32 n = (i32)(row - (i64)e * N);
    const u8* wrow = w + row * pitch;
    T* orow = out + row * K;
    const ScaleZp sz = qp.fetch(e, n, qp.block_of(k0));
    if (k0 + 8 <= K) {
      u32 q[8];
      float v[8];
      if (vec) {
        load_unpack8<BITS, true>(wrow, k0, q);
        qp.weights8(q, sz, v);
        store8_f32<T, true>(orow + k0, v);
      } else {
        load_unpack8<BITS, false>(wrow, k0, q);
        qp.weights8(q, sz, v);
        store8_f32<T, false>(orow + k0, v);
      }
    } else {
      for (i64 k = k0; k < K; ++k) store_f32(orow + k, qp.weight(code_at<BITS>(wrow, k), sz));
    }
  }
}

}  // namespace qmoe
