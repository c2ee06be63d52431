// engines/wgmma_prefill.cuh: the Hopper prefill engine (sm_90a): the grouped GEMMs of mma_prefill.cuh
// on warpgroup MMAs, A = weights dequantized exactly in registers, B = the route tile in shared memory.
//
//   rg (RouteGroups)                  routing/group.cuh, route tiles of BR routes (32, 64, 128; 256 with 2
//                                     warpgroups: 4 × 64 rows × 256 routes needs more than 128 registers)
//   x           [rows, H]   T     the call's input
//   xp          [rows, Hp]  T     x with every 128-value chunk of K in wgmma order (core/wg_order.cuh; Hp = H
//                                 rounded up to 128, zeros past H): FC1's activations, route rows
//                                 gathered by index inside the tile copy
//   act_sorted  [R, Ip]     T     FC1 out in sorted order, in FC2's wgmma order (zeros past I)
//   tile_info   [slots] int4      each route tile's {expert, first sorted position, end, 0}, and
//   tile_rows   [slots, BR] i32   its routes (the last repeated): the tile table wg_prepare writes from 32
//                                 experts (engines/wg_tiles.cuh), so a tile's prologue is one round of loads
//   y           [R, H]      f32   FC2 out by route id, bias added (the combine applies the routing weight)
//                                 (with FC2's K in halves: zeroed by wg_prepare, each half added in)
//   y           [KS, R, H]  f32   with FC2's K in KS parts (YS = R·H): plane p holds part p's sums, part 0's with
//                                 the bias; the combine adds the planes in order
//
// Launches (core/pdl.cuh): the grouping, wg_prepare, FC1, FC2 and the combine each start while the kernel before
// them finishes and wait for it (griddepcontrol.wait) before reading what it wrote. wg_prepare and FC1 wait at
// once; FC1 releases FC2 right after, so FC2's blocks take SMs as FC1's last round leaves them, look up their
// tile and set up their rows (the grouping's and wg_prepare's outputs, complete once FC1's wait returned; read at
// L2, not through the SM's non-coherent caches, as FC2 has not waited yet: ld_gpu in routing/group.cuh), then
// wait for FC1 before their first copy of act_sorted; FC2 releases the combine after that wait.
//
// Pairs (the `_pair` kernels, 128-route tiles on 4 warpgroups, clusters of two; the host chooses per call): the two
// blocks of a cluster compute weight tiles 2j and 2j + 1 of one route tile and copy it once for both
// (engines/wg_mainloop.cuh), from route-tile images (core/wg_order.cuh) instead of rows:
//   xs          [Hp / 64][Rp][64] T   x gathered in sorted order (wg_prepare_image), FC1's input
//   act_sorted  [Ip / 64][Rp][64] T   FC1 out as an image, FC2's input; FC2 does not split K (KS = 1)
// Both forms of a GEMM run one body (fc1_body, fc2_body) with CL = 1 or 2.
//
// The K order of xp and act_sorted: core/wg_order.cuh.
//
// Block and main loop: engines/wg_mainloop.cuh.
#pragma once

#include "core/experts.cuh"
#include "core/pdl.cuh"
#include "core/types.cuh"
#include "core/wg_order.cuh"
#include "engines/tile_rows.cuh"
#include "engines/wg_image.cuh"
#include "engines/wg_mainloop.cuh"
#include "engines/wg_tiles.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "epilogue/fc2.cuh"
#include "routing/group.cuh"
#include "routing/route_group.cuh"

namespace qmoe {

// The stages of the FC1 / FC2 kernels (named in their launch bounds).
template <int GATE, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int BR>
using Fc1Stage = WgStage<B1, ScaleT, BLOCK, Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED), BR>;
template <typename ScaleT, int B2, int Z2, int BLOCK, int BR>
using Fc2Stage = WgStage<B2, ScaleT, BLOCK, Z2 == ZP_PACKED, BR>;

// FC1's launch bounds by route tile, the host's (kernels/wgmma_geometry.py fc1_bound, the generated unit's
// QMOE_WG_FC1_BOUNDS {BR, blocks}): its ring's blocks an SM, at 32-route tiles with two blocks an SM the knob
// prefill_wg_fc1_blocks's (registers for two by default: a ring of four stages fits three times an SM, so where
// ptxas gives FC1 at most 80 registers a thread anyway a third block can start, the host's launch decides:
// launch_smem; setting them for three, at most 80, measured the third block's gain away (H200: gpt-oss-120b 512
// tokens, 76 registers, 726.8 µs against 693.6 with 80 and a third block)).
inline constexpr int wg_fc1_bound(int br) {
  constexpr int rows[][2] = {QMOE_WG_FC1_BOUNDS};
  for (const auto& r : rows)
    if (r[0] == br) return r[1];
  return 0;  // not listed: fc1_body's check fails
}
template <class St, int BR>
inline constexpr int kFc1MinBlocks = wg_fc1_bound(BR);

// After group_by_expert, once a call: xp (x in the chunks' wgmma order; y zeroed for a split FC2) and the
// tile table of `slots` route tiles of BR routes (engines/wg_tiles.cuh); grid-stride, 256 threads a block.
template <typename T, int B>
__global__ void __launch_bounds__(256) wg_prepare(const T* __restrict__ x, i32 rows, i32 H, i32 Hp, T* __restrict__ xp,
                                                  float* __restrict__ y, i64 y_zero, const RouteGroups rg, i32 E, i32 BR,
                                                  i32 slots, i32* __restrict__ tile_info, i32* __restrict__ tile_rows) {
  pdl_wait();     // the grouping's outputs (and x, y: the call's and the previous call's, done before it)
  pdl_release();  // FC1's blocks may start (they wait for this grid)
  build_tile_table(rg, E, BR, slots, (i64)blockIdx.x * 256 + threadIdx.x, (i64)gridDim.x * 256, tile_info, tile_rows);
  wg_permute_rows<T, B>(x, rows, H, Hp, xp, y, y_zero, (i64)blockIdx.x * 256 + threadIdx.x, (i64)gridDim.x * 256);
}

// The forward's first launch for calls of few routes (kernels/route.py routes_in_group), the work of three: block 0
// routes and groups (routing/route_group.cuh) and then writes the tile table; blocks 1.. permute x and zero y as
// wg_prepare does (they read only the call's input, done before this launch, which is never overlapped).
template <typename T, int B, typename LT>
__global__ void __launch_bounds__(kGroupThreads)
wg_route_group(const LT* __restrict__ logits, i32 rows, i32 E_logits, i32 k_routed, i32 S, i32 normalize, i32 E_routed,
               const i32* __restrict__ expert_map, i32* __restrict__ topk_ids, float* __restrict__ topk_w, i32 R, i32 E,
               i32 BR, i32* __restrict__ offsets, i32* __restrict__ tile_offsets, i32* __restrict__ sorted,
               const T* __restrict__ x, i32 H, i32 Hp, T* __restrict__ xp, float* __restrict__ y, i64 y_zero, i32 slots,
               i32* __restrict__ tile_info, i32* __restrict__ tile_rows) {
  pdl_wait();
  pdl_release();  // FC1's blocks may start (they wait for this grid)
  if (blockIdx.x > 0) {
    const i64 n = (i64)(gridDim.x - 1) * kGroupThreads;
    wg_permute_rows<T, B>(x, rows, H, Hp, xp, y, y_zero, (i64)(blockIdx.x - 1) * kGroupThreads + threadIdx.x, n);
    return;
  }
  route_and_group<LT>(logits, rows, E_logits, k_routed, S, normalize, E_routed, expert_map, topk_ids, topk_w, R, E, BR,
                      offsets, tile_offsets, sorted);
  __syncthreads();  // the grouping's stores seen by the whole block
  build_tile_table<true>(RouteGroups{sorted, offsets, tile_offsets}, E, BR, slots, threadIdx.x, kGroupThreads, tile_info,
                         tile_rows);
}

// For the kernels' `_pair` forms (clusters of two blocks), wg_prepare's work with x gathered into a route-tile image instead of permuted
// (engines/wg_image.cuh; one block per kGatherRows sorted rows of every route) and y never zeroed (FC2 does not
// split K there).
template <typename T, int B>
__global__ void __launch_bounds__(256) wg_prepare_image(const T* __restrict__ x, i32 H, i32 Hp, i32 Rp, T* __restrict__ xs,
                                                        const RouteGroups rg, i32 E, i32 k, i32 BR, i32 slots,
                                                        i32* __restrict__ tile_info, i32* __restrict__ tile_rows) {
  pdl_wait();     // the grouping's outputs (and x: the call's, done before it)
  pdl_release();  // FC1's blocks may start (they wait for this grid)
  build_tile_table(rg, E, BR, slots, (i64)blockIdx.x * 256 + threadIdx.x, (i64)gridDim.x * 256, tile_info, tile_rows);
  gather_image_rows<T, B>(x, rg, E, k, H, Hp, Rp, xs);
}

// act_sorted's element of natural column o of sorted row pos (of the route tile from m0): [R, Ip] rows in FC2's
// K order, or in clusters of CL = 2 the route-tile image FC2 copies.
template <int CL, int B2>
__device__ __forceinline__ i64 act_index(i32 pos, i32 m0, i32 o, i32 Ip, i32 Rp) {
  return CL > 1 ? img_index(pos, (pos - m0) & 7, wg_pos<B2>(o), Rp) : (i64)pos * Ip + wg_pos<B2>(o);
}

// FC1 (+FC3) with the activation fused: act_sorted[m, wg_pos<B2>(o)] for the tile's routes (B2: FC2's
// bits, whose order FC2 reads), zeros for I <= o < Ip. Warp tile = 8 outputs (gated) or 16 (plain). The body of
// fc1_wgmma (CL = 1: xp the permuted rows, Rp unused) and fc1_wgmma_pair (CL = 2: xp x's route-tile image of Rp rows).
template <int CL, int GATE, typename T, typename ScaleT, int B1, int B2, int Z1, int Z3, int BLOCK, int ACT, int BR>
__device__ __forceinline__ void fc1_body(const T* __restrict__ xp, const RouteGroups rg, const i32* __restrict__ tile_info,
                                         const i32* __restrict__ tile_rows, i32 E, i32 k, i32 H, i32 Hp, i32 I, i32 Ip, i32 Rp,
                                         i32 NT, i32 G, const Fc1Weights<ScaleT> wt, const ActParams ap, T* __restrict__ act_sorted) {
  using Rows = Fc1Rows<GATE>;
  constexpr bool kZpw = Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED);
  using St = Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>;
  static_assert(kFc1MinBlocks<St, BR> >= St::kMinBlocks && kFc1MinBlocks<St, BR> <= 3,
                "the host's FC1 launch bounds (QMOE_WG_FC1_BOUNDS): the ring's blocks an SM, at most three");
  constexpr int kOut = Rows::kGated ? 8 : 16;
  pdl_wait();     // the tile table and xp (wg_prepare's)
  pdl_release();  // FC2's blocks may start (they wait for this grid before reading act_sorted)
  Stamps st;
  st.start();
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ u32 s_row[BR];  // element offsets of the tile's route rows in xp (< 2^32: the host's bound)
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  i32 nt, e, m0, m_end, route[(BR + St::kThreads - 1) / St::kThreads];
  if (!pf_tile_table<BR, St::kThreads, CL>((i32)blockIdx.x, rg.sorted, rg.offsets, rg.tile_offsets, E, NT, G, tile_info,
                                           tile_rows, nt, e, m0, m_end, route))
    return;  // in clusters both blocks (one route tile)
  const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
  const Proj<ScaleT>& p3 = wt.fc3;
  using Q1 = QuantParams<ScaleT, B1, BLOCK, Z1>;
  using Q3 = QuantParams<ScaleT, B1, BLOCK, Z3>;
  using Second = PfSecond<GATE == GATE_FC3, Q1, Q3>;
  using QB = typename Second::type;
  const Q1 q1{p1.scales, p1.zp, wt.zp_offset, Rows::n1(I), H, Rows::kInterleavedTiles};
  const Q3 q3{p3.scales, p3.zp, wt.zp_offset, I, H};
  const QB& qb = Second::pick(q1, q3);
  const u8* wb = GATE == GATE_FC3 ? p3.w : p1.w;
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const i32 o0 = (nt * St::kWarps + warp) * kOut;
  PfLaneRows<T, Q1, QB, 1> lr;
  {
    const i32 oa = min(o0 + g, I - 1), ob = Rows::kGated ? oa : min(o0 + g + 8, I - 1);  // clamped: never stored
    const i32 na = Rows::gate_row(oa, I), nb = Rows::kGated ? Rows::lin_row(oa, I) : ob;
    lr.set(0, q1, p1.w, na, Rows::tile_row(na), qb, wb, nb, Rows::tile_row(nb), e);
  }
  if constexpr (CL == 1) {
#pragma unroll
    for (int q = 0; q < (BR + St::kThreads - 1) / St::kThreads; ++q)
      if (threadIdx.x + q * St::kThreads < BR) s_row[threadIdx.x + q * St::kThreads] = (u32)(route[q] / k) * (u32)Hp;
  }
  __syncthreads();
  float acc[BR / 2];
#pragma unroll
  for (int i = 0; i < BR / 2; ++i) acc[i] = 0.0f;
  // in clusters xp is x's route-tile image (wg_prepare_image): the tile's rows from m0
  wg_tile<T, B1, BR, kZpw, Q1, QB, St, CL>(q1, qb, lr, e, CL > 1 ? xp + (i64)m0 * 64 : xp, s_row, (i64)Rp * 64, m_end - m0, H, 0,
                                       Hp / 128, acc, smem, st);
  // A thread's outputs are the same for every route of the tile: their biases are read once, here
  // (clamped rows: an output past I is stored as zero, its bias unused).
  const i32 o = o0 + g;
  const Fc1Bias ba = fc1_bias<GATE>(p1.bias, p3.bias, e, min(o, I - 1), I);
  const Fc1Bias bb = Rows::kGated ? ba : fc1_bias<GATE>(p1.bias, p3.bias, e, min(o + 8, I - 1), I);
#pragma unroll
  for (int jn = 0; jn < BR / 8; ++jn) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const i32 pos = m0 + 8 * jn + 2 * t + cc;
      if (pos >= m_end) continue;
      fc1_store_lane<ACT, GATE, T>(acc[4 * jn + cc] * lr.sa[0], acc[4 * jn + 2 + cc] * lr.sb[0], o, I, Ip,  // rows g, g + 8
                                   [&](int h) { return h ? bb : ba; }, ap,
                                   [&](i32 n, T v) { act_sorted[act_index<CL, B2>(pos, m0, n, Ip, Rp)] = v; });
    }
  }
  st.store(0, Hp / 128);
  if constexpr (CL > 1) cluster_wait();  // the other block is done with this one's shared memory (wg_mainloop)
}
template <int GATE, typename T, typename ScaleT, int B1, int B2, int Z1, int Z3, int BLOCK, int ACT, int BR>
__global__ void __launch_bounds__(Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>::kThreads,
                                  (kFc1MinBlocks<Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>, BR>))
fc1_wgmma(const T* __restrict__ xp, const RouteGroups rg, const i32* __restrict__ tile_info, const i32* __restrict__ tile_rows,
          i32 E, i32 k, i32 H, i32 Hp, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G, const Fc1Weights<ScaleT> wt, const ActParams ap,
          T* __restrict__ act_sorted) {
  fc1_body<1, GATE, T, ScaleT, B1, B2, Z1, Z3, BLOCK, ACT, BR>(xp, rg, tile_info, tile_rows, E, k, H, Hp, I, Ip, Rp, NT, G, wt,
                                                              ap, act_sorted);
}
template <int GATE, typename T, typename ScaleT, int B1, int B2, int Z1, int Z3, int BLOCK, int ACT, int BR>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>::kThreads,
                                                            (kFc1MinBlocks<Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>, BR>))
fc1_wgmma_pair(const T* __restrict__ xs, const RouteGroups rg, const i32* __restrict__ tile_info, const i32* __restrict__ tile_rows,
          i32 E, i32 k, i32 H, i32 Hp, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G, const Fc1Weights<ScaleT> wt, const ActParams ap,
          T* __restrict__ act_sorted) {
  fc1_body<2, GATE, T, ScaleT, B1, B2, Z1, Z3, BLOCK, ACT, BR>(xs, rg, tile_info, tile_rows, E, k, H, Hp, I, Ip, Rp, NT, G, wt,
                                                              ap, act_sorted);
}

// Whether FC2 splits K this call. In parts (YS > 0: the host chose KS parts and gave y KS planes of YS values)
// always. In halves (KS = 2, YS = 0: the host launched two blocks a tile, zeroed y, and K has 32 chunks or
// more): when V tiles on P SMs leave the last round of whole tiles at most half full, so that halves take an
// odd number of half rounds, and at most three (measured on the H200: mixtral-8x7b at 512 tokens, V = 1.45 P,
// -7.8 %; at 1024, 2.4 P, +1.3 %; ort-2048 at 1024 / 2048 tokens, 16 chunks, +3 % / +10 %). The same for every
// tile of the call, so a route's sum has the same form whichever tile it lands in.
__device__ __forceinline__ bool fc2_splits(i32 KS, i64 YS, i32 V, i32 P) {
  if (YS) return true;
  const i32 halves = (2 * V + P - 1) / P;  // rounds of half tiles
  return KS == 2 && (halves == 1 || halves == 3);
}

// FC2: y[route, n] = act_sorted[m] · W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
// KS > 1: blocks KS·i + p are tile i's parts of K (chunks [p·nch / KS, (p + 1)·nch / KS)), part 0 with the bias.
// Halves (YS = 0, KS = 2), when fc2_splits: each adds its half into y (zeroed by wg_prepare): y = (0 + lo·s + b)
// + hi·s in either order, one value. Parts (YS > 0): part p stores its sums into plane p (y + p·YS), which the
// combine adds in plane order. The body of fc2_wgmma (CL = 1: act_sorted [R, Ip], Rp unused) and fc2_wgmma_pair
// (CL = 2: KS = 1, act_sorted a route-tile image).
template <int CL, typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__device__ __forceinline__ void fc2_body(const T* __restrict__ act_sorted, const RouteGroups rg, const i32* __restrict__ tile_info,
                                         const i32* __restrict__ tile_rows, i32 E, i32 H, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G,
                                         i32 KS, i32 SMS, i64 YS, const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  using St = Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>;
  constexpr bool kZpw = Z2 == ZP_PACKED;
  if (CL > 1 && KS != 1) __trap();  // a host bug: the two blocks of a cluster would wait for each other forever
  Stamps st;
  st.start();
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ u32 s_row[BR];  // element offsets of the tile's rows in act_sorted (< 2^32: the host's bound)
  __shared__ i32 s_route[BR];
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  // Before the wait below, the grouping's outputs (and the tile table) are read at L2 (ld_gpu, volatile
  // table loads): the wait is what makes the predecessor's writes visible, and these come from earlier kernels.
  // whole tiles: the even blocks (only odd ones read the count here, the others' first loads are their tile's)
  if (blockIdx.x % KS && !fc2_splits(KS, YS, ld_gpu(rg.tile_offsets + E) * NT, SMS)) return;
  i32 nt, e, m0, m_end, route[(BR + St::kThreads - 1) / St::kThreads];
  if (!pf_tile_table<BR, St::kThreads, CL, true>((i32)blockIdx.x / KS, rg.sorted, rg.offsets, rg.tile_offsets, E, NT, G, tile_info,
                                           tile_rows, nt, e, m0, m_end, route))
    return;
  const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
  using Q2 = QuantParams<ScaleT, B2, BLOCK, Z2>;
  const Q2 q2{p2.scales, p2.zp, wt.zp_offset, H, I};
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const i32 n0 = (nt * St::kWarps + warp) * 16;
  PfLaneRows<T, Q2, Q2, 1> lr;
  const i32 na = min(n0 + g, H - 1), nb = min(n0 + g + 8, H - 1);  // clamped: never stored
  lr.set(0, q2, p2.w, na, na, q2, p2.w, nb, nb, e);
#pragma unroll
  for (int q = 0; q < (BR + St::kThreads - 1) / St::kThreads; ++q) {
    const i32 i = threadIdx.x + q * St::kThreads;
    if (i < BR) {
      s_row[i] = (u32)min(m0 + i, m_end - 1) * (u32)Ip;
      s_route[i] = route[q];  // the route whose output row the tile's row i is (read once, not per value)
    }
  }
  __syncthreads();
  // act_sorted (FC1's) from here on. Before, only the grouping's and wg_prepare's outputs: complete once FC1's
  // wait returned, and FC2 starts only after every FC1 block released it, after that wait
  pdl_wait();
  pdl_release();  // the combine's blocks may start (they wait for this grid)
  float acc[BR / 2];
#pragma unroll
  for (int i = 0; i < BR / 2; ++i) acc[i] = 0.0f;
  const i32 part = (i32)blockIdx.x % KS, nch = Ip / 128;
  i32 chunks;
  {
    const bool split = fc2_splits(KS, YS, rg.tile_offsets[E] * NT, SMS);
    const i32 c0 = split ? part * nch / KS : 0, c1 = split ? (part + 1) * nch / KS : nch;
    wg_tile<T, B2, BR, kZpw, Q2, Q2, St, CL>(q2, q2, lr, e, CL > 1 ? act_sorted + (i64)m0 * 64 : act_sorted, s_row, (i64)Rp * 64,
                                         m_end - m0, I, c0, c1, acc, smem, st);
    chunks = c1 - c0;
  }
  // After the main loop, what is the same for the whole block is read again rather than held in
  // registers across it. A thread's rows n, n + 8 are the same for every route of the tile: their biases
  // are read once (the parts after the first add none).
  const bool split = fc2_splits(KS, YS, rg.tile_offsets[E] * NT, SMS);
  if (YS) y += part * YS;  // parts: this part's plane
  const i32 n = n0 + g;
  const bool bias = p2.bias && !part;
  const float bias_a = bias && n < H ? __ldg(p2.bias + (i64)e * H + n) : 0.0f;
  const float bias_b = bias && n + 8 < H ? __ldg(p2.bias + (i64)e * H + n + 8) : 0.0f;
#pragma unroll
  for (int jn = 0; jn < BR / 8; ++jn) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      const i32 i = 8 * jn + 2 * t + cc;
      if (m0 + i >= m_end) continue;
      float* out = y + (i64)s_route[i] * H;
      const float va = acc[4 * jn + cc] * lr.sa[0] + bias_a, vb = acc[4 * jn + 2 + cc] * lr.sb[0] + bias_b;
      const auto v = [&](int h) { return h ? vb : va; };
      if (split && !YS)
        fc2_store_lane(n, H, v, [&](i32 i, float x) { atomicAdd(out + i, x); });
      else
        fc2_store_lane(n, H, v, [&](i32 i, float x) { out[i] = x; });
    }
  }
  st.store(1, chunks);
  if constexpr (CL > 1) cluster_wait();  // the other block is done with this one's shared memory (wg_mainloop)
}
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__global__ void __launch_bounds__(Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>::kThreads, Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>::kMinBlocks)
fc2_wgmma(const T* __restrict__ act_sorted, const RouteGroups rg, const i32* __restrict__ tile_info,
          const i32* __restrict__ tile_rows, i32 E, i32 H, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G, i32 KS, i32 SMS,
          i64 YS, const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  fc2_body<1, T, ScaleT, B2, Z2, BLOCK, BR>(act_sorted, rg, tile_info, tile_rows, E, H, I, Ip, Rp, NT, G, KS, SMS, YS, wt, y);
}
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__global__ void __cluster_dims__(2, 1, 1)
    __launch_bounds__(Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>::kThreads, Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>::kMinBlocks)
fc2_wgmma_pair(const T* __restrict__ act_sorted, const RouteGroups rg, const i32* __restrict__ tile_info,
          const i32* __restrict__ tile_rows, i32 E, i32 H, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G, i32 KS, i32 SMS,
          i64 YS, const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  fc2_body<2, T, ScaleT, B2, Z2, BLOCK, BR>(act_sorted, rg, tile_info, tile_rows, E, H, I, Ip, Rp, NT, G, KS, SMS, YS, wt, y);
}

}  // namespace qmoe
