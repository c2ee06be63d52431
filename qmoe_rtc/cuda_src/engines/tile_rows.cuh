// engines/tile_rows.cuh: what the two tile engines (engines/mma_prefill.cuh, engines/wgmma_prefill.cuh)
// share -- which (weight tile, route tile) a block computes, each lane's weight rows of its warp's m16
// tiles with their row-wise coefficients, and whose quant params FC1's second lane row takes.
#pragma once

#include "core/args.cuh"
#include "core/codes.cuh"
#include "core/dequant.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "routing/group.cuh"

namespace qmoe {

// Tile `idx` of the grid: weight tile nt, route tile G·group + rem % G (false: past the last route
// tile). Consecutive indices take G route tiles of one weight tile, then the next weight tile (L2 reuse).
template <int BR>
__device__ __forceinline__ bool pf_tile_at(i32 idx, const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets,
                                           i32 E, i32 NT, i32 G, i32& nt, i32& e, i32& m0, i32& m_end) {
  const i32 per = G * NT, grp = idx / per, rem = idx - grp * per;
  nt = rem / G;
  return find_tile<BR>(offsets, tile_offsets, E, grp * G + rem % G, e, m0, m_end);
}
// The tile of this block (one block per tile; pf_tile_at of blockIdx.x, in its unsigned arithmetic).
template <int BR>
__device__ __forceinline__ bool pf_tile(const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets, i32 E,
                                        i32 NT, i32 G, i32& nt, i32& e, i32& m0, i32& m_end) {
  const i32 per = G * NT, grp = blockIdx.x / per, rem = blockIdx.x - grp * per;
  nt = rem / G;
  return find_tile<BR>(offsets, tile_offsets, E, grp * G + rem % G, e, m0, m_end);
}
// The tile table, from kTableExperts experts (the wgmma prefill engine's FC kernels read it in one round of
// loads, instead of a binary search over the experts' tile ranges and then the tile's routes: log2(E) + 3
// loads in a row before a tile's first copies, 5.3k cycles from entry to the main loop at 128 experts on the
// H200, session 27's stamps). Measured against the search (one process a tree, two rounds): -1.5 % at
// gpt-oss-120b and -1.7 % at qwen3-30b-a3b 512 tokens (128 experts), -0.5 to -0.8 % at 4096; +2.3 to +2.4 % at
// mixtral-8x7b and ort-2048 512 tokens (8 experts, a search of 3 loads; a block-wide search lost as much there,
// cause not found), so those keep the search.
inline constexpr int kTableExperts = 32;
//
//   tile_info [slots] int4   {e, m0, m_end, 0} of route tile t (find_tile)
//   tile_rows [slots, BR] i32 sorted[min(m0 + i, m_end - 1)]: the tile's routes, the last repeated
// for t < the call's tiles (tile_offsets[E]); `slots` (the launch's route tiles, at least as many) bounds
// the reads, and entries past the tiles are never used. Built by grid-stride thread j of a kernel that runs
// after group_by_expert (wg_prepare).
__device__ __forceinline__ void build_tile_table(const RouteGroups& rg, i32 E, i32 BR, i32 slots, i64 j, i64 stride,
                                                 i32* __restrict__ tile_info, i32* __restrict__ tile_rows) {
  if (E < kTableExperts) return;
  const i32 tiles = rg.tile_offsets[E];
  for (; j < (i64)min(tiles, slots) * BR; j += stride) {
    const i32 t = (i32)(j / BR), i = (i32)(j - (i64)t * BR);
    const i32 e = expert_at(rg.tile_offsets, E, t);
    const i32 m0 = rg.offsets[e] + (t - rg.tile_offsets[e]) * BR, m_end = min(m0 + BR, rg.offsets[e + 1]);
    tile_rows[j] = rg.sorted[min(m0 + i, m_end - 1)];
    if (i == 0) reinterpret_cast<int4*>(tile_info)[t] = make_int4(e, m0, m_end, 0);
  }
}

// A 32-bit load issued where it stands: a volatile load, which ptxas does not move below the branch on the
// tile count that follows it (plain loads it did: the tile's rows were then read only after the count came
// back, two rounds).
__device__ __forceinline__ i32 ld_now(const i32* p) {
  i32 v;
  asm volatile("ld.volatile.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ int4 ld_now4(const i32* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// Tile idx of the grid (pf_tile_at's order): its weight tile nt, expert e, sorted range [m0, m_end), and in
// rows[q] the route of tile row threadIdx.x + q·kThreads (q < ceil(BR / kThreads); rows past BR are not read,
// rows past the tile's routes repeat its last). From kTableExperts experts from the tile table, one round of
// loads; below, pf_tile_at's search and then the routes. False past the call's last tile (the whole block).
template <int BR, int kThreads>
__device__ __forceinline__ bool pf_tile_table(i32 idx, const i32* __restrict__ sorted, const i32* __restrict__ offsets,
                                              const i32* __restrict__ tile_offsets, i32 E, i32 NT, i32 G,
                                              const i32* __restrict__ tile_info, const i32* __restrict__ tile_rows,
                                              i32& nt, i32& e, i32& m0, i32& m_end, i32 (&rows)[(BR + kThreads - 1) / kThreads]) {
  constexpr int Q = (BR + kThreads - 1) / kThreads;
  if (E < kTableExperts) {
    if (!pf_tile_at<BR>(idx, offsets, tile_offsets, E, NT, G, nt, e, m0, m_end)) return false;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const i32 i = threadIdx.x + q * kThreads;
      rows[q] = i < BR ? sorted[min(m0 + i, m_end - 1)] : 0;
    }
    return true;
  }
  const i32 per = G * NT, grp = idx / per, rem = idx - grp * per;
  nt = rem / G;
  const i32 t = grp * G + rem % G;
  const i32 tiles = ld_now(tile_offsets + E);
  const int4 info = ld_now4(tile_info + 4 * (i64)t);
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    const i32 i = threadIdx.x + q * kThreads;
    rows[q] = i < BR ? ld_now(tile_rows + (i64)t * BR + i) : 0;
  }
  e = info.x;
  m0 = info.y;
  m_end = info.z;
  return t < tiles;
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
