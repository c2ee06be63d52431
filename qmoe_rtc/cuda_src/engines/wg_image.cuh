// engines/wg_image.cuh: x gathered into a route-tile image (core/wg_order.cuh), the activations of the
// kernels that copy a route tile in bulk: the tile kernels in clusters (engines/wgmma_prefill.cuh, wg_prepare_image).
#pragma once

#include "core/types.cuh"
#include "core/wg_order.cuh"
#include "routing/group.cuh"

namespace qmoe {

// xs = the route-tile image of x gathered in sorted order: sorted row p is x[sorted[p] / k] in wgmma K order,
// zeros past H. Block b (256 threads) writes sorted rows 8b .. 8b + 7 (kGatherRows), every 16-byte unit of each:
// a route tile starts BR · j rows after its expert's first row, so a row's swizzle, (p - m0) & 7, is
// (p - offsets[e]) & 7 whatever BR is. Blocks past the routes return; rows from offsets[E] on (routes to experts
// this layer does not hold, and past the last route) are not written.
inline constexpr int kGatherRows = 8;
template <typename T, int B>
__device__ __forceinline__ void gather_image_rows(const T* __restrict__ x, const RouteGroups& rg, i32 E, i32 k, i32 H, i32 Hp,
                                                  i32 Rp, T* __restrict__ xs) {
  __shared__ i32 s_row[kGatherRows], s_swz[kGatherRows];
  const i32 p0 = blockIdx.x * kGatherRows;
  if (threadIdx.x < kGatherRows) {
    const i32 p = p0 + threadIdx.x, e = expert_at(rg.offsets, E, p);
    s_row[threadIdx.x] = p < rg.offsets[E] ? rg.sorted[p] / k : -1;
    s_swz[threadIdx.x] = (p - rg.offsets[e]) & 7;
  }
  __syncthreads();
  const i32 units = Hp / 8;
  for (i32 i = threadIdx.x; i < kGatherRows * units; i += 256) {
    const i32 r = i / units, u = i % units, c0 = (u >> 4) * 128, l0 = (u & 15) * 8;
    if (s_row[r] < 0) break;  // rows not held: the rest of the block's items are too (r grows with i)
    const u16* src = reinterpret_cast<const u16*>(x) + (i64)s_row[r] * H;
    u32 v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const i32 n0 = c0 + wg_natural<B>(l0 + 2 * j), n1 = c0 + wg_natural<B>(l0 + 2 * j + 1);
      v[j] = (u32)(n0 < H ? __ldg(src + n0) : 0) | ((u32)(n1 < H ? __ldg(src + n1) : 0) << 16);
    }
    *reinterpret_cast<uint4*>(xs + img_index(p0 + r, s_swz[r], c0 + l0, Rp)) = make_uint4(v[0], v[1], v[2], v[3]);
  }
}

}  // namespace qmoe
