// engines/mma_decode.cuh: the tensor-core decode path (float16 / bfloat16 activations, 1/2/3/4/8-bit
// weights).
//
// Expert-grouped: a block belongs to (row tile, route r); it works only if r is the first route of
// its expert e = ids[r] and then serves every route of e (found by scanning the R route ids in the
// block), so each expert's weights are read once however many tokens chose it. Blocks of the other
// routes of e exit at once. No grouping pass, no extra launch.
//
//   x        [rows, H]         T     input rows (route r reads row r / k)
//   ids, topk_w [R]            i32, f32   routes (route_topk), R = rows·k <= kMmaMaxRoutes
//   W1       [E, N1, H·b/8]    u8    N1 = F·I (+ scales [E, N1(, H/blk)], zero points, bias [E, N1] f32)
//   W3       [E, I, H·b/8]     u8    GATE_FC3 only, same bit width as W1
//   act      [R, I]            T     fc1_mma out (activation rounded to T), fc2_mma_combine in
//   W2       [E, H, I·b/8]     u8
//   y        [R, H]            f32   topk_w[r]·(act[r]·W2[e]ᵀ + b2[e]) of every route
//   counters [ceil(H/rows per block)] u32, zero between calls: blocks done per H tile
//   out      [rows, H]         T     Σ_slot y[row·k + slot] in slot order, rounded once (last block of a tile)
//
// The warp tile, the exact in-register dequantization and the per-warp weight ring are in
// engines/mma_ring.cuh and core/mma_pair.cuh.
// Weights, scales and zero points stream through a per-warp cp.async ring in dynamic shared memory
// (kMmaStages stages of 2 KiB of codes); each lane reads back only what it copied (no barrier).
// Dynamic shared memory: [kMmaWarps rings][s_ids: R i32][s_list: R i32][kMmaWarps x rings, XS > 0:
// engines/x_ring.cuh, the activations of the first XS route lanes of an 8-route pass]; the K-slice reduction
// reuses the rings, so the static shared memory is a few bytes (FC2 8-route: + s_w) and more blocks fit an SM.
// PF: chunks of its rows each warp warms L2 with before the route scan (FC2: before waiting for FC1).
// sr.route (8-route kernels; engines/self_route.cuh): each block routes the call itself into s_ids (FC2: weights into
// s_w), reading neither ids nor topk_w; no routing launch is made, so FC1 is the forward's first launch.
// A block = 4 warps = MT row tiles × KS slices of K (MT·KS = 4, KS a launch argument); the KS
// partial sums are added in a fixed order (deterministic). A pass of BR routes (8, 16 or 32: N8 = BR / 8
// n8 MMA groups) shares the dequantized A fragments; experts with more routes take several passes.
// Not covered (the executor uses the SIMT gemv kernels and logs why): float32 activations,
// zero_point_offset, FC3 with a bit width other than FC1's, 1-bit with block 16, K % 32 ≠ 0.
#pragma once

#include "core/experts.cuh"
#include "core/pdl.cuh"
#include "core/publish.cuh"
#include "core/stamps.cuh"
#include "core/types.cuh"
#include "engines/mma_ring.cuh"
#include "engines/route_scan.cuh"
#include "engines/self_route.cuh"
#include "epilogue/fc1.cuh"
#include "epilogue/fc2.cuh"

// Expert flow (QMOE_MMA_EXPERT_FLOW; the host passes 1 unless QMOE_RTC_MMA_EXPERT_FLOW=0): FC2's blocks
// of expert e wait only for e's FC1 blocks instead of the whole FC1 grid (griddepcontrol.wait), 1.6-3.2 %
// faster at 1 token on the H200 (docs/performance-log.md). Each FC1 block that computed tile x of
// expert e counts itself in fc1_done[e] after its act stores (threadfence + atomicAdd); an FC2 block of
// e spins (acquire) until fc1_done[e] == FC1_TILES, FC1's grid.x, then counts itself in fc2_seen[e];
// the last of e's FC2 blocks zeroes both (every FC2 block of e has passed by then, and the next call's first
// launch, routing or FC1, waits for this grid). No deadlock: FC2 starts only once every FC1 block has released it
// (core/pdl.cuh), i.e. is resident or done. FC2 then reads act through L2.
#ifndef QMOE_MMA_EXPERT_FLOW
#define QMOE_MMA_EXPERT_FLOW 0
#endif

namespace qmoe {

inline constexpr bool kMmaExpertFlow = QMOE_MMA_EXPERT_FLOW;
// XR kernels (the `_xr` variants, calls of up to a few tokens: kernels/mma_decode.py x_staged): the 8-route pass
// stages its activations in shared memory with the weights (engines/x_ring.cuh), XS route lanes (the call's
// tokens); registers set for kMmaXRingBlocks blocks an SM, the host's (kernels/mma_decode.py X_RING_BLOCKS, in the
// generated unit), and a route lane's part of the x ring the host's bytes (QMOE_MMA_FC1_X_LANE, QMOE_MMA_FC2_X_LANE:
// x_ring_bytes), which the kernels check. An expert with more routes than XS would have lanes without their
// activations: trap, never compute them as zeros.
#if !defined(QMOE_MMA_X_RING_BLOCKS) || !defined(QMOE_MMA_FC1_X_LANE) || !defined(QMOE_MMA_FC2_X_LANE)
#error "QMOE_MMA_X_RING_BLOCKS, QMOE_MMA_FC1_X_LANE and QMOE_MMA_FC2_X_LANE come from the host (kernels/mma_decode.py)"
#endif
inline constexpr int kMmaXRingBlocks = QMOE_MMA_X_RING_BLOCKS;
template <int BR, bool XR> constexpr int mma_decode_blocks() { return XR ? kMmaXRingBlocks : mma_min_blocks<BR>(); }
// The kernels whose rings take a gate (engines/mma_ring.cuh NoGate: weights copied while the block scans its routes
// or waits for its act): the 8-route ones (calls of up to 8 tokens) with a scale per chunk (block 0 or >= 128). The
// 16- and 32-route kernels scan and wait first (gated, ptxas spilled 16 more bytes in mixtral int3's 32-route FC2),
// and so do smaller scale blocks (gated, gpt-oss-120b's block-32 FC1 took 127 registers instead of 96 and the layer
// 2.8-5 % longer at 1-2 tokens on an H100; docs/performance-log.md).
template <int N8, int BLOCK> constexpr bool mma_gated_ring() { return N8 == 1 && (BLOCK == 0 || BLOCK >= kMmaChunk); }
template <bool XR> __device__ __forceinline__ void check_x_lanes(i32 XS, i32 routes) {
  if constexpr (XR) {
    if (routes > XS || XS > 8) __trap();
  }
}

// FC1: this block's tile of expert e is written (all threads call it; core/publish.cuh).
__device__ __forceinline__ void flow_count_fc1(u32* fc1_done, i32 e) { block_publish_add(fc1_done + e); }

// FC2: wait until every FC1 tile of expert e is written (all threads call it; block-uniform).
__device__ __forceinline__ void flow_wait_fc1(u32* fc1_done, u32* fc2_seen, i32 e, i32 fc1_tiles) {
  if (threadIdx.x == 0) {
    u32 n;
    for (;;) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(fc1_done + e) : "memory");
      if (n >= (u32)fc1_tiles) break;
      __nanosleep(32);
    }
    if (atomicAdd(fc2_seen + e, 1u) == gridDim.x - 1) {  // the last FC2 block of e: reset for the next call
      fc1_done[e] = 0u;
      fc2_seen[e] = 0u;
    }
  }
  __syncthreads();
}

// Rows per 16-row warp tile: gated FC1 = 8 outputs (rows g: gate, g + 8: linear); else 16 outputs.
template <int GATE, typename T, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int ACT, int BR, bool XR = false>
__global__ void __launch_bounds__(kMmaThreads, (mma_decode_blocks<BR, XR>()))
fc1_mma(const T* __restrict__ x, const i32* __restrict__ ids, i32 R, i32 k, i32 H, i32 I, i32 KS, i32 PF, i32 XS,
        const Fc1Weights<ScaleT> wt, const ActParams ap, const SelfRoute sr, T* __restrict__ act,
        u32* __restrict__ fc1_done) {
  constexpr int N8 = BR / 8;  // n8 MMA route groups per pass
  static_assert(!XR || N8 == 1, "x rings serve one route group");
  __shared__ i32 s_n;
  extern __shared__ __align__(16) u8 dyn_smem[];
  using Stage = MmaStage<B1, ScaleT, BLOCK, Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED)>;
  constexpr i32 kRing = kMmaStages * Stage::kBytes;
  static_assert(kRing >= N8 * 4 * 32 * 4, "a ring holds its warp's partial sums (reduce_slices)");
  static_assert(mma_ring_is<Stage, BR>(QMOE_MMA_FC1_RING) && MmaXRing<Stage>::kLaneBytes == QMOE_MMA_FC1_X_LANE,
                "the host's FC1 ring and x ring bytes or blocks an SM (the generated unit) and this layout disagree");
  const i32 xs = XR ? XS : 0;  // route lanes whose activations the x rings stage (engines/x_ring.cuh)
  check_ring_size<Stage>(R, xs);
  i32* s_ids = reinterpret_cast<i32*>(dyn_smem + kMmaWarps * kRing);  // [R] after the rings
  i32* s_list = s_ids + R;                                             // [R]
  using Rows = Fc1Rows<GATE>;
  constexpr bool kGated = Rows::kGated;
  constexpr int kOutPerTile = kGated ? 8 : 16;
  DecodeStamps stamps;  // diagnostics only (core/stamps.cuh): empty unless QMOE_DECODE_STAMPS
  stamps.start();
  pdl_wait();     // the route ids come from the routing kernel launched just before (core/pdl.cuh)
  pdl_release();  // FC2's blocks may start: routing is complete (or each routes itself), so they can read the ids
  bool routed = false;  // the ids in s_ids, from this block's own routing
  if constexpr (N8 == 1) routed = self_route<T>(sr, R, wt.E_routed, s_ids, nullptr);
  else if (sr.route) __trap();  // the host routes in the 8-route kernels only
  stamps.mark(1);
  i32 e = routed ? s_ids[blockIdx.y] : ids[blockIdx.y];
  if (e < 0) return;  // an expert this layer does not hold (expert slices [ext]): FC2 skips the route too
  const i32 eid = e;  // the route's expert id (routed or shared): the expert flow's counter
  const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
  const Proj<ScaleT>& p3 = wt.fc3;
  const i32 N1 = Rows::n1(I);
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{p1.scales, p1.zp, wt.zp_offset, N1, H, Rows::kInterleavedTiles};
  const QuantParams<ScaleT, B1, BLOCK, Z3> q3{p3.scales, p3.zp, wt.zp_offset, I, H};
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i32 MT = kMmaWarps / KS, mt = warp % MT, ks = warp / MT;
  const i32 g = lane >> 2, t = lane & 3;
  const i32 o0 = (blockIdx.x * MT + mt) * kOutPerTile;
  // lane rows: gated: gate and linear row of output o0 + g; plain: outputs o0 + g, o0 + g + 8 (clamped:
  // computed, never stored)
  const i32 oa = min(o0 + g, I - 1), ob = kGated ? oa : min(o0 + g + 8, I - 1);
  const i32 na = Rows::gate_row(oa, I), nb = kGated ? Rows::lin_row(oa, I) : ob;
  using Codes = CodeRows<B1>;  // contract or tiled layout (core/codes.cuh)
  const u8* pa = p1.w + Codes::row(e, N1, Rows::tile_row(na), H);
  const u8* pb = GATE == GATE_FC3 ? p3.w + Codes::row(e, I, nb, H) : p1.w + Codes::row(e, N1, Rows::tile_row(nb), H);
  if (R <= kMmaPrefetchRoutes) prefetch_rows<B1>(pa, pb, H, ks, KS, PF);
  // The route scan: this block's routes, or none (another block has its expert). Token 0's routes (r < k) are
  // never an earlier route's duplicate (a token's k experts differ), so in the 8-route kernels (up to 8 tokens;
  // mma_gated_ring) their blocks scan in the ring's gate, with the first stages' weights already on their way
  // (engines/mma_ring.cuh NoGate); the others scan first.
  ExpertRoutes er{0};
  bool scanned = false;
  const i32 pre_id = mma_gated_ring<N8, BLOCK>() && !routed ? load_route_id(ids, R) : 0;
  auto scan = [&]() -> bool {
    if (!scanned) {
      scanned = true;
      er = collect_routes<true>(ids, R, s_ids, s_list, &s_n, pre_id, routed);
      if (er.n > 0) {
        check_x_lanes<XR>(XS, er.n);
        stamps.mark(2);
      }
    }
    return er.n > 0;
  };
  if constexpr (mma_gated_ring<N8, BLOCK>()) {
    if ((i32)blockIdx.y >= k && !scan()) {
      stamps.store(0, 1, 0);
      return;
    }
  } else {
    er = collect_routes(ids, R, s_ids, s_list, &s_n, 0, routed);
    if (er.n == 0) {
      stamps.store(0, 1, 0);
      return;
    }
    check_x_lanes<XR>(XS, er.n);
    stamps.mark(2);
  }

  // (a gated block of token 0 enters its first pass before its scan has counted its routes)
  for (i32 p = 0; (mma_gated_ring<N8, BLOCK>() && p == 0) || p < er.n; p += 8 * N8) {
    const T* xrow[N8];
    auto rows_of_pass = [&]() {
#pragma unroll
      for (int gg = 0; gg < N8; ++gg) {
        const i32 j = p + 8 * gg + g;
        xrow[gg] = j < er.n ? x + (i64)(s_list[j] / k) * H : nullptr;
      }
    };
    float acc[N8][4] = {};
    u8* ring = dyn_smem + warp * kRing;
    u8* xring = dyn_smem + mma_x_rings<Stage>(R) + warp * mma_x_ring_bytes<Stage>(xs);
    auto product = [&](auto ring_gate) -> bool {
      if constexpr (GATE == GATE_FC3)
        return mma_rows<T, B1, N8, false, false, XR>(q1, pa, na, q3, pb, nb, e, xrow, H, ks, KS, acc, ring, xring, xs,
                                                     ring_gate);
      else  // both rows from W1
        return mma_rows<T, B1, N8, false, Rows::kPairedRows, XR>(q1, pa, na, q1, pb, nb, e, xrow, H, ks, KS, acc, ring,
                                                                 xring, xs, ring_gate);
    };
    if constexpr (mma_gated_ring<N8, BLOCK>()) {
      auto gate = [&]() -> bool {  // the routes known, the pass's activation rows
        if (!scan()) return false;
        rows_of_pass();
        return true;
      };
      if (!product(gate)) {  // block-uniform: a duplicate (never for token 0's routes)
        stamps.store(0, 1, 0);
        return;
      }
    } else {
      rows_of_pass();
      product(NoGate{});
    }
    reduce_slices<N8>(acc, mt, ks, MT, KS, dyn_smem, kRing);
    if (ks == 0) {
#pragma unroll
      for (int gg = 0; gg < N8; ++gg) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const i32 j = p + 8 * gg + 2 * t + c;
          if (j >= er.n) continue;
          const i64 r = s_list[j];
          const i32 o = o0 + g;
          fc1_store_lane<ACT, GATE, T>(acc[gg][c], acc[gg][2 + c], o, I, I,  // rows g, g + 8
                                       [&](int h) { return fc1_bias<GATE>(p1.bias, p3.bias, e, o + 8 * h, I); }, ap,
                                       [&](i32 n, T v) { act[r * I + n] = v; });
        }
      }
    }
  }
  stamps.mark(3);
  if constexpr (kMmaExpertFlow) flow_count_fc1(fc1_done, eid);
  stamps.store(0, 3, er.n);
}

template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR, bool XR = false>
__global__ void __launch_bounds__(kMmaThreads, (mma_decode_blocks<BR, XR>()))
fc2_mma_combine(const T* __restrict__ act, const i32* __restrict__ ids, const float* __restrict__ topk_w, i32 R, i32 k,
                i32 H, i32 I, i32 KS, i32 PF, i32 XS, const Fc2Weights<ScaleT> wt, const SelfRoute sr,
                float* __restrict__ y, u32* __restrict__ counters, T* __restrict__ out, u32* __restrict__ fc1_done,
                u32* __restrict__ fc2_seen, i32 FC1_TILES) {
  constexpr int N8 = BR / 8;  // n8 MMA route groups per pass
  __shared__ i32 s_n;
  __shared__ bool s_last;
  __shared__ float s_w[N8 == 1 ? kSelfRouteMaxRoutes : 1];  // [R] the routing weights where the block routes itself
  extern __shared__ __align__(16) u8 dyn_smem[];
  using Stage = MmaStage<B2, ScaleT, BLOCK, Z2 == ZP_PACKED>;
  constexpr i32 kRing = kMmaStages * Stage::kBytes;
  static_assert(kRing >= N8 * 4 * 32 * 4, "a ring holds its warp's partial sums (reduce_slices)");
  static_assert(mma_ring_is<Stage, BR>(QMOE_MMA_FC2_RING) && MmaXRing<Stage>::kLaneBytes == QMOE_MMA_FC2_X_LANE,
                "the host's FC2 ring and x ring bytes or blocks an SM (the generated unit) and this layout disagree");
  const i32 xs = XR ? XS : 0;  // route lanes whose activations the x rings stage (engines/x_ring.cuh)
  check_ring_size<Stage>(R, xs);
  i32* s_ids = reinterpret_cast<i32*>(dyn_smem + kMmaWarps * kRing);  // [R] after the rings
  i32* s_list = s_ids + R;                                             // [R]
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i32 MT = kMmaWarps / KS, mt = warp % MT, ks = warp / MT;
  const i32 g = lane >> 2, t = lane & 3;
  DecodeStamps stamps;  // diagnostics only (core/stamps.cuh): empty unless QMOE_DECODE_STAMPS
  stamps.start();
  // Before pdl_wait (core/pdl.cuh): only the route ids (complete once FC1 released this grid; read
  // through L2, or routed here from the logits, an input) and the weights, so the prefetch below overlaps FC1's tail.
  bool routed = false;  // the ids in s_ids, the weights in s_w, from this block's own routing
  if constexpr (N8 == 1) routed = self_route<T>(sr, R, wt.E_routed, s_ids, s_w);
  else if (sr.route) __trap();  // the host routes in the 8-route kernels only
  i32 e = routed ? s_ids[blockIdx.y] : __ldcg(ids + blockIdx.y);
  const i32 eid = e;  // the route's expert id: the expert flow's counter
  const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
  const i32 n0 = (blockIdx.x * MT + mt) * 16;
  const i32 na = min(n0 + g, H - 1), nb = min(n0 + g + 8, H - 1);
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{p2.scales, p2.zp, wt.zp_offset, H, I};
  const u8* pa = p2.w + CodeRows<B2>::row(e, H, na, I);  // contract or tiled layout (core/codes.cuh)
  const u8* pb = p2.w + CodeRows<B2>::row(e, H, nb, I);
  // e < 0: an expert this layer does not hold (expert slices [ext]): nothing to compute, but the block
  // still counts for its tile below (block-uniform, so collect_routes' barriers are skipped by all)
  if (e >= 0 && R <= kMmaPrefetchRoutes) prefetch_rows<B2>(pa, pb, I, ks, KS, PF);
  if constexpr (!kMmaExpertFlow) pdl_wait();  // act (FC1's output) from here on
  const ExpertRoutes er = e < 0 ? ExpertRoutes{0} : collect_routes(ids, R, s_ids, s_list, &s_n, 0, routed);
  stamps.mark(1);
  // The ring's gate (engines/mma_ring.cuh NoGate): the first stages' weights are on their way while the block
  // waits for its expert's act (expert flow).
  auto wait_act = [&]() {
    if constexpr (kMmaExpertFlow) flow_wait_fc1(fc1_done, fc2_seen, eid, FC1_TILES);  // this expert's act from here on
    stamps.mark(2);
    check_x_lanes<XR>(XS, er.n);
  };
  if constexpr (!mma_gated_ring<N8, BLOCK>()) {
    if (er.n > 0) wait_act();
  }
  for (i32 p = 0; p < er.n; p += 8 * N8) {
    const T* xrow[N8];
#pragma unroll
    for (int gg = 0; gg < N8; ++gg) {
      const i32 j = p + 8 * gg + g;
      xrow[gg] = j < er.n ? act + (i64)s_list[j] * I : nullptr;
    }
    float acc[N8][4] = {};
    u8* ring = dyn_smem + warp * kRing;
    u8* xring = dyn_smem + mma_x_rings<Stage>(R) + warp * mma_x_ring_bytes<Stage>(xs);
    if constexpr (mma_gated_ring<N8, BLOCK>()) {
      auto gate = [&, p]() -> bool {
        if (p == 0) wait_act();
        return true;
      };
      mma_rows<T, B2, N8, kMmaExpertFlow, true, XR>(q2, pa, na, q2, pb, nb, e, xrow, I, ks, KS, acc, ring, xring, xs,
                                                    gate);
    } else {
      mma_rows<T, B2, N8, kMmaExpertFlow, true, XR>(q2, pa, na, q2, pb, nb, e, xrow, I, ks, KS, acc, ring, xring, xs);
    }
    reduce_slices<N8>(acc, mt, ks, MT, KS, dyn_smem, kRing);
    if (ks == 0) {
#pragma unroll
      for (int gg = 0; gg < N8; ++gg) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const i32 j = p + 8 * gg + 2 * t + c;
          if (j >= er.n) continue;
          const i64 r = s_list[j];
          const float wr = routed ? s_w[r] : __ldcg(topk_w + r);  // routing's (complete: see the ids above)
          fc2_store_lane(
              n0 + g, H,
              [&](int h) { return wr * (acc[gg][2 * h + c] + (p2.bias ? __ldg(p2.bias + (i64)e * H + (h ? nb : na)) : 0.0f)); },
              [&](i32 n, float v) { y[r * H + n] = v; });
        }
      }
    }
  }
  stamps.mark(3);
  // expert flow: FC1 has finished when FC2 does, as for every grid of the chain (core/pdl.cuh)
  if constexpr (kMmaExpertFlow) pdl_wait();
  // The last of the R blocks of this H tile adds the routes' y in slot order (read through L2) and resets the
  // counter (core/publish.cuh).
  if (!block_publish_last(&counters[blockIdx.x], (u32)R, &s_last)) {
    stamps.store(1, er.n > 0 ? 3 : 1, er.n);
    return;
  }
  const i32 rows = R / k, tile = 16 * MT, h0 = blockIdx.x * tile;
  for (i32 idx = threadIdx.x; idx < rows * tile; idx += kMmaThreads) {
    const i32 row = idx / tile, n = h0 + idx % tile;
    if (n >= H) continue;
    float v = 0.0f;
    for (i32 slot = 0; slot < k; ++slot) {
      const i32 id = routed ? s_ids[row * k + slot] : ids[(i64)row * k + slot];
      if (id >= 0) v += __ldcg(y + ((i64)row * k + slot) * H + n);
    }
    out[(i64)row * H + n] = Traits<T>::from_float(v);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
  stamps.store(1, er.n > 0 ? 3 : 1, er.n);
}

}  // namespace qmoe
