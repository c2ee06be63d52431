// routing/group.cuh: group routes by expert on the device, in one block (no host sync).
//
//   topk_ids     [R]      i32   expert of route r (r = row*k + slot); -1 (expert slices [ext]): left out
//   offsets      [E + 1]  i32   (out) first sorted position of expert e; offsets[E] = the routes kept (R
//                                without ids of -1)
//   tile_offsets [E + 1]  i32   (out) first GEMM tile of expert e (tiles of BR routes); tile_offsets[E] = tiles
//   sorted       [R]      i32   (out) route ids in expert order, ascending inside each expert: a stable counting
//                                sort, the same on every launch. Which routes share a tile (and so how a route's
//                                sums are formed) must not depend on timing: graph replays equal eager calls
//                                bitwise only then (atomics, which placed routes in arrival order, once did not).
//
// Launch: one block of kGroupThreads threads, no dynamic shared memory (routing/route_group.cuh: the same
// grouping after the block routed the call itself). Any E (the families keep E at most
// kGroupMaxExperts, shared experts [ext] counted); experts are taken kGroupSlice at a time.
//
// How the order is made: warp w owns the contiguous routes [w·L, (w + 1)·L) (L a multiple of 32, so warps
// cover the routes in route order). For each slice of experts: (A) every warp counts its routes per expert into
// its own row of a table (lanes_alike groups the lanes of one expert; the lowest lane adds the group's
// size); (B) one thread per expert turns its column into exclusive prefix sums over the warps, plus the
// expert's first position (a block scan over the experts, carried across slices); (C) every warp walks its
// routes again, a route's place being its warp's next position for the expert plus its rank among the
// lanes before it with that expert. Warps, steps and lanes all follow route order: the sort is stable.
//
// find_tile: what a GEMM block of tile t works on (binary search over tile_offsets).
#pragma once

#include "core/pdl.cuh"
#include "core/types.cuh"

namespace qmoe {

inline constexpr int kGroupThreads = 1024;
inline constexpr int kGroupWarps = kGroupThreads / 32;
inline constexpr int kGroupMaxExperts = kGroupThreads - 1;  // the families' limit (kernels/_grouped.py)
inline constexpr int kGroupSlice = 256;                      // experts a pass: a kGroupWarps × 256 i32 table, 32 KB
inline constexpr int kGroupUnroll = 4;                       // steps of 32 routes whose ids are loaded together

// The lanes of the warp whose key equals this lane's (key an expert id < kGroupMaxExperts, or -1): one ballot per
// bit of key + 1, intersected. __match_any_sync gives the same mask, but the sort built on it made qwen3's layer
// at 4096 tokens (32768 routes in this one block) ~50 us slower than the atomics before it (H100).
__device__ __forceinline__ unsigned lanes_alike(i32 key) {
  constexpr int kBits = 10;  // key + 1 <= kGroupMaxExperts = 1023: 10 bits
  static_assert(kGroupMaxExperts < (1 << kBits), "lanes_alike: key + 1 must fit kBits bits");
  const unsigned k = (unsigned)(key + 1);
  unsigned peers = 0xffffffffu;
#pragma unroll
  for (int b = 0; b < kBits; ++b) {
    const unsigned bit = (k >> b) & 1u;
    const unsigned m = __ballot_sync(0xffffffffu, bit);
    peers &= bit ? m : ~m;
  }
  return peers;
}

// One step of a warp over 32 consecutive routes: the lane's route r, its key (expert, or -1: not in this
// slice) and peers (the lanes of its key, lanes_alike). PLACE false: add each expert's lanes to the warp's
// count row. PLACE true: write each lane's route at its place (row[] holds the warp's next position per
// expert) and advance row[] past the group.
template <bool PLACE>
__device__ __forceinline__ void group_step(i32 key, unsigned peers, i32 r, i32 e0, i32* row, i32* __restrict__ sorted) {
  const int lane = threadIdx.x & 31, leader = __ffs(peers) - 1;
  i32 base = 0;
  if (key >= 0 && lane == leader) {  // one leader per expert: no two lanes touch one entry
    base = row[key - e0];
    row[key - e0] = base + __popc(peers);
  }
  if constexpr (PLACE) {
    base = __shfl_sync(0xffffffffu, base, leader);  // every lane from its own group's leader
    if (key >= 0) sorted[base + __popc(peers & ((1u << lane) - 1u))] = r;
  }
  __syncwarp();  // the next step's leader may be another lane: it must see this one's update
}

// Walks this warp's routes [r0, r1) once for the experts [e0, e1) (group_step): the ids and lane groups of
// kGroupUnroll steps first (independent of the table), then their table updates in order.
template <bool PLACE>
__device__ __forceinline__ void group_walk(const i32* __restrict__ topk_ids, i32 r0, i32 r1, i32 e0, i32 e1, i32* row,
                                           i32* __restrict__ sorted) {
  const int lane = threadIdx.x & 31;
  for (i32 s = r0; s < r1; s += 32 * kGroupUnroll) {  // warp-uniform bounds: every lane runs every step
    i32 key[kGroupUnroll];
    unsigned peers[kGroupUnroll];
#pragma unroll
    for (int u = 0; u < kGroupUnroll; ++u) {
      const i32 r = s + 32 * u + lane;
      const i32 id = r < r1 ? topk_ids[r] : -1;
      key[u] = id >= e0 && id < e1 ? id : -1;  // -1 ids (experts not held: slices [ext]) are never placed
    }
#pragma unroll
    for (int u = 0; u < kGroupUnroll; ++u) peers[u] = lanes_alike(key[u]);
#pragma unroll
    for (int u = 0; u < kGroupUnroll; ++u) group_step<PLACE>(key[u], peers[u], s + 32 * u + lane, e0, row, sorted);
  }
}

// The grouping by one block of kGroupThreads threads: topk_ids [R] in global memory (group_by_expert) or shared
// memory (routing/route_group.cuh, which routes in the same block first).
__device__ __forceinline__ void group_routes(const i32* __restrict__ topk_ids, i32 R, i32 E, i32 BR, i32* __restrict__ offsets,
                                             i32* __restrict__ tile_offsets, i32* __restrict__ sorted) {
  __shared__ i32 table[kGroupWarps][kGroupSlice];  // [warp][expert of the slice]: counts, then next positions
  __shared__ i32 warp_tot[2][kGroupWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // this warp's routes: L per warp, whole steps of 32
  const i32 L = (R + kGroupThreads - 1) / kGroupThreads * 32;
  const i32 r0 = min((i32)warp * L, R), r1 = min(r0 + L, R);
  const int nw = L ? min(kGroupWarps, (int)((R + L - 1) / L)) : 0;  // warps holding routes: only their rows are used
  i32 carry_c = 0, carry_t = 0;  // routes and tiles of the slices before (the same in every thread)
  for (i32 e0 = 0; e0 < E; e0 += kGroupSlice) {
    const i32 e1 = min(e0 + kGroupSlice, E);
    for (int i = tid; i < nw * kGroupSlice; i += kGroupThreads) (&table[0][0])[i] = 0;
    __syncthreads();
    group_walk<false>(topk_ids, r0, r1, e0, e1, table[warp], sorted);  // (A) counts per warp
    __syncthreads();

    // (B) thread tid owns expert e0 + tid: its count, then an exclusive scan of (count, tiles) over the
    // slice's experts (one per thread, kGroupSlice <= kGroupThreads), then its column turned into positions
    const bool mine = tid < e1 - e0;
    i32 c = 0;
    if (mine)
      for (int w = 0; w < nw; ++w) c += table[w][tid];
    const i32 t = (c + BR - 1) / BR;
    i32 sc = c, st = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const i32 a = __shfl_up_sync(0xffffffffu, sc, o);
      const i32 b = __shfl_up_sync(0xffffffffu, st, o);
      if (lane >= o) {
        sc += a;
        st += b;
      }
    }
    if (lane == 31) {
      warp_tot[0][warp] = sc;
      warp_tot[1][warp] = st;
    }
    __syncthreads();
    i32 base_c = carry_c + sc - c, base_t = carry_t + st - t;  // exclusive: this warp's lanes before, ...
    const int sw = (e1 - e0 + 31) / 32;  // the warps owning the slice's experts (the others' totals are 0)
    for (int w = 0; w < sw; ++w) {
      if (w < warp) {  // ... and the warps before
        base_c += warp_tot[0][w];
        base_t += warp_tot[1][w];
      }
      carry_c += warp_tot[0][w];  // the slice's totals, the same in every thread
      carry_t += warp_tot[1][w];
    }
    if (mine) {
      offsets[e0 + tid] = base_c;
      tile_offsets[e0 + tid] = base_t;
      i32 next = base_c;  // warp w's first position for this expert: the expert's, plus the warps before
      for (int w = 0; w < nw; ++w) {
        const i32 n = table[w][tid];
        table[w][tid] = next;
        next += n;
      }
    }
    __syncthreads();
    group_walk<true>(topk_ids, r0, r1, e0, e1, table[warp], sorted);  // (C) places
    __syncthreads();  // the table and warp_tot are refilled for the next slice
  }
  if (tid == 0) {
    offsets[E] = carry_c;
    tile_offsets[E] = carry_t;
  }
}

// A template (of nothing) so that only a program naming it compiles it: a module built in parts
// (CompileUnit.parts) names it in one of them, and the others leave it out.
template <typename = void>
__global__ void __launch_bounds__(kGroupThreads)
group_by_expert(const i32* __restrict__ topk_ids, i32 R, i32 E, i32 BR, i32* __restrict__ offsets,
                i32* __restrict__ tile_offsets, i32* __restrict__ sorted) {
  pdl_wait();     // the ids are the routing kernel's (a no-op unless launched overlapped: core/pdl.cuh)
  pdl_release();  // the next kernel's blocks may start (they wait for this grid)
  group_routes(topk_ids, R, E, BR, offsets, tile_offsets, sorted);
}

// An i32 read at the GPU's point of coherence (L2; relaxed, gpu scope) instead of through the SM's own caches.
// For reads of the grouping's outputs made before a kernel's pdl_wait: PTX promises visibility of the direct
// predecessor's writes only after the wait. The grouping (two launches back) had finished before the predecessor
// released this grid, so its writes have reached L2; a copy in an SM's non-coherent cache has no such promise
// (the scratch is reused call after call: it could hold an earlier call's values).
__device__ __forceinline__ i32 ld_gpu(const i32* p) {
  i32 v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
// *p, or with GPU ld_gpu(p) (reads before a pdl_wait, see above).
template <bool GPU>
__device__ __forceinline__ i32 ld_group(const i32* p) {
  if constexpr (GPU) return ld_gpu(p);
  else return *p;
}

// The largest e < E with starts[e] <= v (starts nondecreasing, starts[0] <= v): the expert whose range of
// starts (offsets: sorted positions; tile_offsets: tiles) holds v, experts with an empty range skipped.
// GPU: ld_gpu reads (before a pdl_wait).
template <bool GPU = false>
__device__ __forceinline__ i32 expert_at(const i32* __restrict__ starts, i32 E, i32 v) {
  i32 lo = 0, hi = E - 1;
  while (lo < hi) {
    const i32 mid = (lo + hi + 1) >> 1;
    if (ld_group<GPU>(starts + mid) <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Expert and first sorted position of tile t; false for a tile past the last one. GPU: ld_gpu reads.
template <int BR, bool GPU = false>
__device__ __forceinline__ bool find_tile(const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets, i32 E,
                                          i32 t, i32& e, i32& m0, i32& m_end) {
  if (t >= ld_group<GPU>(tile_offsets + E)) return false;
  e = expert_at<GPU>(tile_offsets, E, t);
  m0 = ld_group<GPU>(offsets + e) + (t - ld_group<GPU>(tile_offsets + e)) * BR;
  m_end = min(m0 + BR, ld_group<GPU>(offsets + e + 1));
  return true;
}

}  // namespace qmoe
