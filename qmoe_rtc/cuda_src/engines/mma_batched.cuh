// engines/mma_batched.cuh: the batched-decode engine (float16 / bfloat16 activations, 1/2/3/4/8-bit
// weights): the decode engine's weight stream (engines/mma_ring.cuh: each warp streams its own rows
// through a cp.async ring, K split over the warps of a block, mma.sync with the weights as A) over the
// routes grouped by expert (routing/group.cuh), so any number of routes: batched decode and chunked
// prefill with few routes per expert, where the prefill engines' 128-row tiles leave too few warps
// streaming and have no K split (mixtral-8x7b's FC2: 256 blocks).
//
//   sorted, offsets   routing/group.cuh: route ids in expert order, expert e's at [offsets[e], offsets[e+1])
//   x           [rows, H]   T     FC1's activations, row = route / k (read in place)
//   act_sorted  [R, I]      T     FC1 out in sorted order (activation rounded to T), FC2's activations
//   y           [R, H]      f32   FC2 out by route id, bias added (combine_routes applies the routing weight)
//
// Grid: (output tiles, experts): block (x, e) computes MT·16·RT rows of expert e (4 warps = MT warp
// tiles × KS slices of K, as the decode engine; a warp tile is RT 16-row tiles) for every route of e,
// BR routes (8, 16 or 32: N8 = BR / 8 n8 MMA groups) per pass over the weights; experts without routes exit at once. Codes in the contract or
// the tiled layout (core/codes.cuh); RT (QMOE_BATCHED_RT) 2 needs the tiled layout: each route group's
// activations feed two row tiles' MMAs. XBK (the _xb kernels, the host's choice per call: kernels/mma_batched.py
// x_block): the block copies its pass's activations once into shared memory after the four rings, where every warp
// reads them (engines/x_block.cuh), instead of each lane loading its own from global memory just before its MMAs.
// Not covered (the executor says why and runs another engine): float32 activations, zero_point_offset,
// FC3 with a bit width other than FC1's, 1-bit with block 16, K % 32 != 0.
#pragma once

#include "core/codes.cuh"
#include "core/experts.cuh"
#include "core/types.cuh"
#include "engines/mma_ring.cuh"
#include "engines/x_block.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "epilogue/fc2.cuh"
#include "routing/group.cuh"
#include "routing/route_group.cuh"

#ifndef QMOE_BATCHED_RT
#error "QMOE_BATCHED_RT comes from the host (kernels/mma_batched.py row_tiles)"
#endif

namespace qmoe {

inline constexpr int kBatchedRT = QMOE_BATCHED_RT;  // 16-row tiles per warp (kernels/mma_batched.py row_tiles)

// Blocks per SM the registers are set for: the host's (kernels/mma_batched.py min_blocks, the generated unit's
// QMOE_MMA_BLOCKS; why 3 / 2 at 16 / 32 routes with two row tiles: there).
template <int BR> constexpr int batched_min_blocks() { return mma_min_blocks<BR>(); }

// The launch gives the four rings, then with XBK the block's x stages (kernels/mma_batched.py sizes it so): trap,
// never overrun.
template <class Stage, bool XBK, int N8> __device__ __forceinline__ void check_batched_smem(i32 KS) {
  u32 have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < (u32)(kMmaWarps * kMmaStages * Stage::kBytes) + x_block_bytes<XBK, N8>(kMmaStages, KS, Stage::KST))
    __trap();
}

// The block's x stages for the pass from sorted position p (XBK; else nothing): thread tid copies route
// p + tid / 16 + 8·gg's activations, row_of(j) for sorted position j < m1.
template <class XB, class Stage, typename T, class RowOf>
__device__ __forceinline__ XB batched_x(u8* smem, i32 KS, i32 p, i32 m1, const T* any, RowOf row_of) {
  XB xb{};
  if constexpr (XB::kOn) {
    xb.base = (u32)__cvta_generic_to_shared(smem + kMmaWarps * kMmaStages * Stage::kBytes);
    xb.step = KS * Stage::KST;
    xb.any = reinterpret_cast<const u8*>(any);
#pragma unroll
    for (int gg = 0; gg < XB::kRoutes / 8; ++gg) {
      const i32 j = p + (i32)(threadIdx.x >> 4) + 8 * gg;
      xb.src[gg] = j < m1 ? reinterpret_cast<const u8*>(row_of(j)) : nullptr;
    }
  }
  return xb;
}

// FC1 (+FC3) with the activation fused: act_sorted[pos, o] for every route of expert blockIdx.y.
template <int GATE, typename T, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int ACT, int BR, bool XBK>
__global__ void __launch_bounds__(kMmaThreads, batched_min_blocks<BR>())
fc1_batched(const T* __restrict__ x, const i32* __restrict__ sorted, const i32* __restrict__ offsets, i32 k, i32 H,
            i32 I, i32 KS, const Fc1Weights<ScaleT> wt, const ActParams ap, T* __restrict__ act_sorted) {
  constexpr int N8 = BR / 8;  // n8 MMA route groups per pass
  extern __shared__ __align__(16) u8 dyn_smem[];
  constexpr int RT = kBatchedRT;
  using Stage = MmaStage<B1, ScaleT, BLOCK, Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED), RT>;
  constexpr i32 kRing = kMmaStages * Stage::kBytes;
  static_assert(kRing >= RT * N8 * 4 * 32 * 4, "a ring holds its warp's partial sums (reduce_slices)");
  static_assert(mma_ring_is<Stage, BR>(QMOE_MMA_FC1_RING), "the host's FC1 ring bytes or blocks an SM and this layout disagree");
  check_batched_smem<Stage, XBK, N8>(KS);
  using XB = typename XBlockOf<XBK, N8>::type;
  using Rows = Fc1Rows<GATE>;
  constexpr bool kGated = Rows::kGated;
  constexpr int kOutPerTile = kGated ? 8 : 16;
  i32 e = blockIdx.y;
  const i32 m0 = offsets[e], m1 = offsets[e + 1];
  if (m0 >= m1) return;  // no routes (block-uniform)
  const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
  const Proj<ScaleT>& p3 = wt.fc3;
  const i32 N1 = Rows::n1(I);
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{p1.scales, p1.zp, wt.zp_offset, N1, H, Rows::kInterleavedTiles};
  const QuantParams<ScaleT, B1, BLOCK, Z3> q3{p3.scales, p3.zp, wt.zp_offset, I, H};
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i32 MT = kMmaWarps / KS, mt = warp % MT, ks = warp / MT;
  const i32 g = lane >> 2, t = lane & 3;
  const i32 o0 = (blockIdx.x * MT + mt) * kOutPerTile * RT;
  // lane rows of tile i as in the decode engine: gate and linear row of output o0 + i·8 + g, or outputs
  // o0 + i·16 + g and + 8 (clamped: computed, never stored)
  using Codes = CodeRows<B1>;
  i32 na[RT], nb[RT];
  const u8* pa[RT];
  const u8* pb[RT];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    const i32 oi = o0 + i * kOutPerTile;
    const i32 oa = min(oi + g, I - 1), ob = kGated ? oa : min(oi + g + 8, I - 1);
    na[i] = Rows::gate_row(oa, I);
    nb[i] = kGated ? Rows::lin_row(oa, I) : ob;
    pa[i] = p1.w + Codes::row(e, N1, Rows::tile_row(na[i]), H);
    pb[i] = GATE == GATE_FC3 ? p3.w + Codes::row(e, I, nb[i], H) : p1.w + Codes::row(e, N1, Rows::tile_row(nb[i]), H);
  }
  u8* ring = dyn_smem + warp * kRing;
  for (i32 p = m0; p < m1; p += 8 * N8) {
    const T* xrow[N8];
#pragma unroll
    for (int gg = 0; gg < N8; ++gg) {
      const i32 j = p + 8 * gg + g;
      xrow[gg] = j < m1 ? x + (i64)(sorted[j] / k) * H : nullptr;
    }
    const XB xb = batched_x<XB, Stage>(dyn_smem, KS, p, m1, x, [&](i32 j) { return x + (i64)(sorted[j] / k) * H; });
    float acc[RT * N8][4] = {};
    if constexpr (GATE == GATE_FC3)
      mma_tiles<T, B1, N8, RT>(q1, pa, na, q3, pb, nb, e, xrow, H, ks, KS, acc, ring, nullptr, 0, NoGate{}, xb);
    else
      mma_tiles<T, B1, N8, RT, false, Rows::kPairedRows>(q1, pa, na, q1, pb, nb, e, xrow, H, ks, KS, acc, ring, nullptr,
                                                         0, NoGate{}, xb);
    reduce_slices<RT * N8>(acc, mt, ks, MT, KS, dyn_smem, kRing);
    if (ks != 0) continue;
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const i32 oi = o0 + i * kOutPerTile;
#pragma unroll
      for (int gg = 0; gg < N8; ++gg) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const i32 pos = p + 8 * gg + 2 * t + c;
          if (pos >= m1) continue;
          T* out = act_sorted + (i64)pos * I;
          const i32 o = oi + g;
          fc1_store_lane<ACT, GATE, T>(acc[i * N8 + gg][c], acc[i * N8 + gg][2 + c], o, I, I,  // rows g, g + 8
                                       [&](int h) { return fc1_bias<GATE>(p1.bias, p3.bias, e, o + 8 * h, I); }, ap,
                                       [&](i32 n, T v) { out[n] = v; });
        }
      }
    }
  }
}

// FC2: y[route, n] = act_sorted[pos] · W2[e, n] + b2[e, n] for every route of expert blockIdx.y.
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR, bool XBK>
__global__ void __launch_bounds__(kMmaThreads, batched_min_blocks<BR>())
fc2_batched(const T* __restrict__ act_sorted, const i32* __restrict__ sorted, const i32* __restrict__ offsets, i32 H,
            i32 I, i32 KS, const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  constexpr int N8 = BR / 8;  // n8 MMA route groups per pass
  extern __shared__ __align__(16) u8 dyn_smem[];
  constexpr int RT = kBatchedRT;
  using Stage = MmaStage<B2, ScaleT, BLOCK, Z2 == ZP_PACKED, RT>;
  constexpr i32 kRing = kMmaStages * Stage::kBytes;
  static_assert(kRing >= RT * N8 * 4 * 32 * 4, "a ring holds its warp's partial sums (reduce_slices)");
  static_assert(mma_ring_is<Stage, BR>(QMOE_MMA_FC2_RING), "the host's FC2 ring bytes or blocks an SM and this layout disagree");
  check_batched_smem<Stage, XBK, N8>(KS);
  using XB = typename XBlockOf<XBK, N8>::type;
  i32 e = blockIdx.y;
  const i32 m0 = offsets[e], m1 = offsets[e + 1];
  if (m0 >= m1) return;
  const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i32 MT = kMmaWarps / KS, mt = warp % MT, ks = warp / MT;
  const i32 g = lane >> 2, t = lane & 3;
  const i32 n0 = (blockIdx.x * MT + mt) * 16 * RT;
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{p2.scales, p2.zp, wt.zp_offset, H, I};
  i32 na[RT], nb[RT];
  const u8* pa[RT];
  const u8* pb[RT];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    na[i] = min(n0 + 16 * i + g, H - 1);  // clamped: never stored
    nb[i] = min(n0 + 16 * i + g + 8, H - 1);
    pa[i] = p2.w + CodeRows<B2>::row(e, H, na[i], I);
    pb[i] = p2.w + CodeRows<B2>::row(e, H, nb[i], I);
  }
  u8* ring = dyn_smem + warp * kRing;
  for (i32 p = m0; p < m1; p += 8 * N8) {
    const T* xrow[N8];
#pragma unroll
    for (int gg = 0; gg < N8; ++gg) {
      const i32 j = p + 8 * gg + g;
      xrow[gg] = j < m1 ? act_sorted + (i64)j * I : nullptr;
    }
    const XB xb = batched_x<XB, Stage>(dyn_smem, KS, p, m1, act_sorted, [&](i32 j) { return act_sorted + (i64)j * I; });
    float acc[RT * N8][4] = {};
    mma_tiles<T, B2, N8, RT, false, true>(q2, pa, na, q2, pb, nb, e, xrow, I, ks, KS, acc, ring, nullptr, 0, NoGate{}, xb);
    reduce_slices<RT * N8>(acc, mt, ks, MT, KS, dyn_smem, kRing);
    if (ks != 0) continue;
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const i32 ni = n0 + 16 * i;
#pragma unroll
      for (int gg = 0; gg < N8; ++gg) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const i32 pos = p + 8 * gg + 2 * t + c;
          if (pos >= m1) continue;
          float* out = y + (i64)sorted[pos] * H;
          fc2_store_lane(
              ni + g, H,
              [&](int h) { return acc[i * N8 + gg][2 * h + c] + (p2.bias ? __ldg(p2.bias + (i64)e * H + (h ? nb[i] : na[i])) : 0.0f); },
              [&](i32 n, float v) { out[n] = v; });
        }
      }
    }
  }
}

}  // namespace qmoe
