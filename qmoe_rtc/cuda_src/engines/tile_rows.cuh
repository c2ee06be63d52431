// engines/tile_rows.cuh: what the two tile engines (engines/mma_prefill.cuh, engines/wgmma_prefill.cuh)
// share -- which (weight tile, route tile) a block computes, each lane's weight rows of its warp's m16
// tiles with their row-wise coefficients, and whose quant params FC1's second lane row takes.
#pragma once

#include "core/codes.cuh"
#include "core/dequant.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "routing/group.cuh"

namespace qmoe {

// Tile `idx` of the grid: weight tile nt, and the route tile it returns, G·group + rem % G. Consecutive
// indices take G route tiles of one weight tile, then the next weight tile (L2 reuse). CL > 1 (clusters of CL
// blocks, NT a multiple of CL): CL consecutive indices take CL consecutive weight tiles of one route tile, and
// consecutive clusters G route tiles of those weight tiles, then the next CL.
template <int CL = 1>
__device__ __forceinline__ i32 grid_tile(i32 idx, i32 NT, i32 G, i32& nt) {
  const i32 cl = idx / CL, per = G * (NT / CL), grp = cl / per, rem = cl - grp * per;
  nt = rem / G * CL + (idx - cl * CL);
  return grp * G + rem % G;
}
// grid_tile's route tile found in the experts' ranges (false: past the last route tile). GPU: find_tile's.
template <int BR, int CL = 1, bool GPU = false>
__device__ __forceinline__ bool pf_tile_at(i32 idx, const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets,
                                           i32 E, i32 NT, i32 G, i32& nt, i32& e, i32& m0, i32& m_end) {
  return find_tile<BR, GPU>(offsets, tile_offsets, E, grid_tile<CL>(idx, NT, G, nt), e, m0, m_end);
}
// The tile of this block (one block per tile; pf_tile_at of blockIdx.x, in its unsigned arithmetic).
template <int BR>
__device__ __forceinline__ bool pf_tile(const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets, i32 E,
                                        i32 NT, i32 G, i32& nt, i32& e, i32& m0, i32& m_end) {
  const i32 per = G * NT, grp = blockIdx.x / per, rem = blockIdx.x - grp * per;
  nt = rem / G;
  return find_tile<BR>(offsets, tile_offsets, E, grp * G + rem % G, e, m0, m_end);
}
// Tile indices a persistent grid walks: every group of G route tiles × NT weight tiles (the route
// tiles counted by the grouping kernel: tile_offsets[E]).
__device__ __forceinline__ i32 pf_tile_count(const i32* __restrict__ tile_offsets, i32 E, i32 NT, i32 G) {
  return (tile_offsets[E] + G - 1) / G * G * NT;
}

// Row-wise scales (BLOCK == 0): a lane row's coefficients and scale, read once (block-wise: per chunk).
template <typename T, class QP>
__device__ __forceinline__ Coef pf_row_coef(const QP& qp, i32 e, i32 n, float& scale) {
  if constexpr (QP::kBlock == 0) {
    const ScaleZp sz = qp.fetch(e, n, 0);
    scale = sz.scale;
    return MmaDeq<T, QP::kBits, QP::kZp>::coef(sz);
  } else {
    scale = 1.0f;
    return MmaDeq<T, QP::kBits, QP::kZp>::zero();
  }
}

// The lane's two weight rows of each of its warp's kPfMW tiles (rows g and g + 8 of the tile): row
// indices, code pointers, and for row-wise scales their coefficients and scales (1 when block-wise).
// MW: the warp's m16 tiles (the mma.sync engine's warps own kPfMW, the wgmma engine's one).
template <typename T, class QA, class QB, int MW> struct PfLaneRows {
  i32 na[MW], nb[MW];
  const u8* pa[MW];
  const u8* pb[MW];
  Coef rca[MW], rcb[MW];
  float sa[MW], sb[MW];

  // Warp tile m reads row n_a of (qa, wa) and row n_b of (qb, wb) of expert e (same bits and K); m_a,
  // m_b: their tile rows (core/codes.cuh; the rows themselves but for interleaved FC1 rows, tiled).
  __device__ __forceinline__ void set(int m, const QA& qa, const u8* wa, i32 n_a, i32 m_a, const QB& qb, const u8* wb,
                                      i32 n_b, i32 m_b, i32 e) {
    na[m] = n_a;
    nb[m] = n_b;
    pa[m] = wa + CodeRows<QA::kBits>::row(e, qa.N, m_a, qa.K);
    pb[m] = wb + CodeRows<QA::kBits>::row(e, qb.N, m_b, qb.K);
    rca[m] = pf_row_coef<T>(qa, e, n_a, sa[m]);
    rcb[m] = pf_row_coef<T>(qb, e, n_b, sb[m]);
  }
};

// The quant params of FC1's second lane row: FC3's under GATE_FC3, else FC1's own.
template <bool FC3, class Q1, class Q3> struct PfSecond {
  using type = Q1;
  static __device__ __forceinline__ const type& pick(const Q1& q1, const Q3&) { return q1; }
};
template <class Q1, class Q3> struct PfSecond<true, Q1, Q3> {
  using type = Q3;
  static __device__ __forceinline__ const type& pick(const Q1&, const Q3& q3) { return q3; }
};

}  // namespace qmoe
