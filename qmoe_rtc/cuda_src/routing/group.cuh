// routing/group.cuh: group routes by expert on the device, in one block (no host sync).
//
//   topk_ids     [R]      i32   expert of route r (r = row*k + slot); -1 (expert slices [ext]): left out
//   offsets      [E + 1]  i32   (out) first sorted position of expert e; offsets[E] = R
//   tile_offsets [E + 1]  i32   (out) first GEMM tile of expert e (tiles of BR routes); tile_offsets[E] = tiles
//   sorted       [R]      i32   (out) route ids in expert order (order inside an expert is arbitrary:
//                                every route's result depends on its own row only)
//
// Launch: one block of kGroupThreads threads. E < kGroupThreads (E counts shared experts [ext] too).
// find_tile: what a GEMM block of tile t works on (binary search over tile_offsets).
#pragma once

#include "core/pdl.cuh"
#include "core/types.cuh"

namespace qmoe {

inline constexpr int kGroupThreads = 1024;
inline constexpr int kGroupMaxExperts = kGroupThreads - 1;  // the scan gives each expert one thread, and one more

// A template (of nothing) so that only a program naming it compiles it: a module built in parts
// (CompileUnit.parts) names it in one of them, and the others leave it out.
template <typename = void>
__global__ void __launch_bounds__(kGroupThreads)
group_by_expert(const i32* __restrict__ topk_ids, i32 R, i32 E, i32 BR, i32* __restrict__ offsets,
                i32* __restrict__ tile_offsets, i32* __restrict__ sorted) {
  __shared__ i32 count[kGroupMaxExperts];
  __shared__ i32 cursor[kGroupMaxExperts];
  __shared__ i32 warp_tot[2][kGroupThreads / 32];
  pdl_wait();     // the ids are the routing kernel's (a no-op unless launched overlapped: core/pdl.cuh)
  pdl_release();  // the next kernel's blocks may start (they wait for this grid)
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kGroupThreads) count[e] = 0;
  __syncthreads();
  for (i32 r = tid; r < R; r += kGroupThreads)  // id -1: an expert this layer does not hold (slices [ext])
    if (topk_ids[r] >= 0) atomicAdd(&count[topk_ids[r]], 1);
  __syncthreads();

  // exclusive scans of count[] and ceil(count/BR)[] (E < kGroupThreads: one entry per thread)
  const int lane = tid & 31, warp = tid >> 5;
  const i32 c = tid < E ? count[tid] : 0;
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
  i32 base_c = 0, base_t = 0;
  for (int w = 0; w < warp; ++w) {
    base_c += warp_tot[0][w];
    base_t += warp_tot[1][w];
  }
  const i32 excl_c = base_c + sc - c, excl_t = base_t + st - t;
  if (tid < E) {
    offsets[tid] = excl_c;
    tile_offsets[tid] = excl_t;
    cursor[tid] = excl_c;
  }
  if (tid == E) {  // E < kGroupThreads: this thread's inclusive totals are the grand totals
    offsets[E] = excl_c;
    tile_offsets[E] = excl_t;
  }
  __syncthreads();
  for (i32 r = tid; r < R; r += kGroupThreads) {
    if (topk_ids[r] < 0) continue;
    const i32 pos = atomicAdd(&cursor[topk_ids[r]], 1);
    sorted[pos] = r;
  }
}

// The largest e < E with starts[e] <= v (starts nondecreasing, starts[0] <= v): the expert whose range of
// starts (offsets: sorted positions; tile_offsets: tiles) holds v, experts with an empty range skipped.
__device__ __forceinline__ i32 expert_at(const i32* __restrict__ starts, i32 E, i32 v) {
  i32 lo = 0, hi = E - 1;
  while (lo < hi) {
    const i32 mid = (lo + hi + 1) >> 1;
    if (starts[mid] <= v) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Expert and first sorted position of tile t; false for a tile past the last one.
template <int BR>
__device__ __forceinline__ bool find_tile(const i32* __restrict__ offsets, const i32* __restrict__ tile_offsets, i32 E,
                                          i32 t, i32& e, i32& m0, i32& m_end) {
  if (t >= tile_offsets[E]) return false;
  e = expert_at(tile_offsets, E, t);
  m0 = offsets[e] + (t - tile_offsets[e]) * BR;
  m_end = min(m0 + BR, offsets[e + 1]);
  return true;
}

}  // namespace qmoe
