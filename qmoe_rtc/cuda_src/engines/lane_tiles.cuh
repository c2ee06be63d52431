// engines/lane_tiles.cuh: the weight operand of the tensor-core tile engines' main loops
// (engines/mma_prefill.cuh, engines/wgmma_prefill.cuh) -- one m16 weight tile
// as a warp stages it for a 128-code chunk of K and decodes it into mma A fragments.
//
// A lane (g, t) owns 32 consecutive codes of rows g and g + 8 of the tile (core/mma_pair.cuh) and the
// scale / zero-point words of those codes (core/lane_meta.cuh). In a stage, a tile's lane rows are
//   codes [2 rows][32 lanes][4·B B]       row b 32 lanes after row a
//   meta  [2 rows][kWords][32] u32        row b kWords·128 bytes after row a (block-wise scales only:
//                                         row-wise scales are read once, before the loop)
// Where the codes and meta regions of a warp's (or a block's) tiles sit is the engine's stage layout:
// the callers compute the lane's addresses. Every stage layout sizes its tiles with LaneTileBytes;
// mma_prefill reads its tiles back with lane_tile_load. Left in place, because a
// shared version changed the generated code (SASS compared module by module) and no GPU
// run has measured the change: the copies (cp.async) of mma_prefill and wgmma_prefill, and
// wgmma_prefill's read-back, interleaved with its wgmma fences.
#pragma once

#include "core/lane_meta.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"

namespace qmoe {

// Bytes of MW tiles' lane rows in a stage: their codes, then their meta words.
template <int B, typename ScaleT, int BLOCK, bool ZPW, int MW> struct LaneTileBytes {
  static constexpr int kWords = BLOCK ? MetaLayout<ScaleT, BLOCK, ZPW, B>::kWords : 0;
  static constexpr int kCB = 4 * B;  // code bytes per lane row per chunk
  static constexpr int kCodes = MW * 2 * 32 * kCB;
  static constexpr int kBytes = kCodes + MW * 2 * kWords * 128;
};

// Read back a staged tile's lane rows: their codes (ra, rb, from the lane's slots code_a, code_b) and the
// coefficients of their NSB scale blocks (ca, cb): decoded from the lane's meta words (ma: row a's word
// 0; row b's WORDS·32 words on) with block-wise scales, else the row-wise rca, rcb computed before the
// loop. j0: the lane's first block; `live` false (lanes past K) gives zero coefficients.
template <typename T, int B, int WORDS, bool ZPW, int NSB, class QA, class QB>
__device__ __forceinline__ void lane_tile_load(const u8* code_a, const u8* code_b, const u32* ma, const QA& qa, i64 sba,
                                               i32 na, Coef rca, const QB& qb, i64 sbb, i32 nb, Coef rcb, i32 e, i32 j0,
                                               bool live, u32 (&ra)[B], u32 (&rb)[B], Coef (&ca)[NSB],
                                               Coef (&cb)[NSB]) {
  using D = MmaDeq<T, B, QA::kZp>;
  lds_codes<B>(code_a, ra);
  lds_codes<B>(code_b, rb);
#pragma unroll
  for (int h = 0; h < NSB; ++h) {
    if constexpr (QA::kBlock != 0) {
      const u32* mb = ma + WORDS * 32;
      ca[h] = live ? D::coef(LaneMeta<QA, ZPW>::decode(qa, ma, sba, e, na, j0, h)) : D::zero();
      cb[h] = live ? D::coef(LaneMeta<QB, ZPW>::decode(qb, mb, sbb, e, nb, j0, h)) : D::zero();
    } else {
      ca[h] = live ? rca : D::zero();
      cb[h] = live ? rcb : D::zero();
    }
  }
}

}  // namespace qmoe
