// engines/wg_tiles.cuh: the tile table of the wgmma prefill engine (engines/wgmma_prefill.cuh, whose
// wg_prepare writes it with the permuted input): which route tile a block computes, read in one round of
// loads where the other tile engines search for it (engines/tile_rows.cuh, pf_tile_at).
#pragma once

#include "core/args.cuh"
#include "core/types.cuh"
#include "engines/tile_rows.cuh"
#include "routing/group.cuh"

namespace qmoe {

// The tile table, written from kTableExperts experts:
//   tile_info [slots] int4      {e, m0, m_end, 0} of route tile t (as find_tile gives them)
//   tile_rows [slots, BR] i32   sorted[min(m0 + i, m_end - 1)]: the tile's routes, the last repeated
// for t < the call's tiles (tile_offsets[E]); `slots` (the launch's route tiles, at least as many) bounds the
// reads, and entries past the tiles are never used. The wgmma prefill FC kernels read their tile's entry in one
// round of loads, instead of a binary search over the experts' tile ranges and then the tile's routes (log2(E)
// + 3 loads in a row before a tile's first copies: 5.3k cycles from entry to the main loop at 128 experts on the
// H200, by clock stamps in the kernel). Measured against the search (a process a tree, two rounds): -1.1 to -1.5 % at
// gpt-oss-120b and -1.7 % at qwen3-30b-a3b 512 tokens (128 experts), -0.5 to -0.9 % at 4096; +2.3 to +2.4 % at
// mixtral-8x7b and ort-2048 512 tokens (8 experts, a search of 3 loads; a block-wide search lost as much there,
// cause not found), so those keep the search.
inline constexpr int kTableExperts = 32;

// Writes the table: grid-stride thread j of a kernel that runs after group_by_expert (wg_prepare), or of the block
// that grouped (wg_route_group, GPU: the grouping's outputs read at L2 with ld_gpu, never from a cache that could
// hold the previous call's, after the block barrier that follows their stores).
template <bool GPU = false>
__device__ __forceinline__ void build_tile_table(const RouteGroups& rg, i32 E, i32 BR, i32 slots, i64 j, i64 stride,
                                                 i32* __restrict__ tile_info, i32* __restrict__ tile_rows) {
  if (E < kTableExperts) return;
  const i32 tiles = ld_group<GPU>(rg.tile_offsets + E);
  for (; j < (i64)min(tiles, slots) * BR; j += stride) {
    const i32 t = (i32)(j / BR), i = (i32)(j - (i64)t * BR);
    const i32 e = expert_at<GPU>(rg.tile_offsets, E, t);
    const i32 m0 = ld_group<GPU>(rg.offsets + e) + (t - ld_group<GPU>(rg.tile_offsets + e)) * BR;
    const i32 m_end = min(m0 + BR, ld_group<GPU>(rg.offsets + e + 1));
    tile_rows[j] = ld_group<GPU>(rg.sorted + min(m0 + i, m_end - 1));
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

// Tile idx of the grid (grid_tile's order): its weight tile nt, expert e, sorted range [m0, m_end), and in
// rows[q] the route of tile row threadIdx.x + q·kThreads (q < ceil(BR / kThreads); rows past BR are not read,
// rows past the tile's routes repeat its last). From kTableExperts experts from the tile table, one round of
// loads; below, pf_tile_at's search and then the routes. False past the call's last tile (the whole block).
// CL: the grid's clusters (grid_tile). GPU: the search's reads with ld_gpu too, for a caller that has not
// passed its pdl_wait yet (FC2; the table's own reads are volatile, never from a non-coherent cache).
template <int BR, int kThreads, int CL = 1, bool GPU = false>
__device__ __forceinline__ bool pf_tile_table(i32 idx, const i32* __restrict__ sorted, const i32* __restrict__ offsets,
                                              const i32* __restrict__ tile_offsets, i32 E, i32 NT, i32 G,
                                              const i32* __restrict__ tile_info, const i32* __restrict__ tile_rows,
                                              i32& nt, i32& e, i32& m0, i32& m_end, i32 (&rows)[(BR + kThreads - 1) / kThreads]) {
  constexpr int Q = (BR + kThreads - 1) / kThreads;
  if (E < kTableExperts) {
    if (!pf_tile_at<BR, CL, GPU>(idx, offsets, tile_offsets, E, NT, G, nt, e, m0, m_end)) return false;
#pragma unroll
    for (int q = 0; q < Q; ++q) {
      const i32 i = threadIdx.x + q * kThreads;
      rows[q] = i < BR ? ld_group<GPU>(sorted + min(m0 + i, m_end - 1)) : 0;
    }
    return true;
  }
  const i32 t = grid_tile<CL>(idx, NT, G, nt);
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

}  // namespace qmoe
