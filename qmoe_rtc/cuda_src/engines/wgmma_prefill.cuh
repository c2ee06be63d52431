// engines/wgmma_prefill.cuh: the Hopper prefill engine (sm_90a): the grouped GEMMs of mma_prefill.cuh
// on warpgroup MMAs, A = weights dequantized exactly in registers, B = the route tile in shared memory.
//
//   rg (RouteGroups)                  routing/group.cuh, route tiles of BR routes (64, 128; 256 with 2
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
//                                 (with FC2 split over K: zeroed by wg_prepare, each half added in)
//
// The K order of xp and act_sorted: core/wg_order.cuh. The warp-specialised, persistent variant of
// this engine: engines/wgmma_ws.cuh (the same layouts; its own gather, no tile table).
//
// Block: WgStage::kGroups warpgroups × 64 weight rows (warp w: rows 16w .. 16w + 15 of the tile, the
// mma_prefill lane layout with one m16 tile) × BR routes; acc[BR / 2] f32 per thread (core/wgmma.cuh).
// K in chunks of 128 through a cp.async ring of WgStage::kStages stages (as many as fit, at most
// QMOE_WG_STAGES); per k16 step a warp builds its A fragment while the previous QMOE_WG_INFLIGHT MMAs
// run. With three stages or more the copies run S - 2 chunks ahead and a chunk's last MMA overlaps the
// next chunk (the slot refilled is two chunks old); with two, each chunk drains its MMAs before the
// slot is reused.
#pragma once

#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/experts.cuh"
#include "core/lane_meta.cuh"
#include "core/mma_pair.cuh"
#include "core/stamps.cuh"
#include "core/types.cuh"
#include "core/wg_order.cuh"
#include "core/wgmma.cuh"
#include "engines/lane_tiles.cuh"
#include "engines/tile_rows.cuh"
#include "engines/wg_tiles.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "routing/group.cuh"

namespace qmoe {

#ifndef QMOE_WG_GROUPS
#define QMOE_WG_GROUPS 0  // warpgroups per block, 2 or 4 for every tile; 0: WgStage::kGroups decides
#endif
#ifndef QMOE_WG_STAGES
#define QMOE_WG_STAGES 4
#endif
inline constexpr int kWgMaxStages = QMOE_WG_STAGES;
#ifndef QMOE_WG_INFLIGHT
#define QMOE_WG_INFLIGHT 1
#endif
inline constexpr int kWgInflight = QMOE_WG_INFLIGHT;  // MMAs a warpgroup keeps in flight (1 or 2), A buffers: one more
static_assert(kWgInflight == 1 || kWgInflight == 2, "QMOE_WG_INFLIGHT must be 1 or 2");
inline constexpr int kWgSmemBudget = 227 * 1024 - 1024 - 4096;  // dynamic bytes for stages (alignment slack, static)

// One pipeline stage (1024-aligned, in dynamic shared memory):
//   x     [2 halves][BR][128 B]                 logical k 0..63 / 64..127 of the tile's routes,
//                                               128-byte swizzle (unit u of row r at u ^ (r & 7))
//   codes [warps][2 rows][32 lanes][4·B B]      each lane's 32 codes of its two rows
//   meta  [warps][2 rows][kWords][32] u32       their scale / zp words (block-wise scales only)
// A block has kGroups warpgroups × 64 weight rows: 2 at 64-route tiles where four stages of 2 warpgroups
// fit twice in an SM's 228 KiB (with 1 KiB alignment slack, 1 KiB the system's and ~1 KiB static a
// block), so two blocks share it and one's first copies and epilogue overlap the other's main loop; 4
// otherwise (an SM then holds one block: with 2 it measured 12-16 % slower at int8; tile_groups in
// kernels/wgmma_geometry.py mirrors this). QMOE_WG_GROUPS forces 2 or 4 (with 4, 256 routes' accumulators
// do not fit a thread's 128 registers).
template <int B, typename ScaleT, int BLOCK, bool ZPW, int BR> struct WgStage {
  using W = LaneTileBytes<B, ScaleT, BLOCK, ZPW, 1>;  // a warp's tile (engines/lane_tiles.cuh)
  static constexpr int kXBytes = BR * 256;
  static constexpr int kWords = W::kWords;
  static constexpr int kCB = W::kCB;
  static constexpr int kWarpCodes = W::kCodes;
  static constexpr int kWarpBytes = W::kBytes;
  static constexpr int kBytes2 = (kXBytes + 8 * kWarpBytes + 1023) / 1024 * 1024;  // a stage of 2 warpgroups
  static constexpr bool kShare = BR <= 64 && kWgMaxStages >= 4 && 2 * (4 * kBytes2 + 3072) <= 228 * 1024;
  static constexpr int kGroups = QMOE_WG_GROUPS ? QMOE_WG_GROUPS : kShare ? 2 : 4;
  static constexpr int kThreads = 128 * kGroups, kWarps = 4 * kGroups;  // a warp: one m16 weight tile
  static constexpr int kMinBlocks = kGroups == 2 && BR <= 64 ? 2 : 1;   // registers for two blocks an SM
  static constexpr int kBytes = (kXBytes + kWarps * kWarpBytes + 1023) / 1024 * 1024;
  static constexpr int kStages = kWgSmemBudget / kBytes < kWgMaxStages ? kWgSmemBudget / kBytes : kWgMaxStages;
  static_assert(kStages >= 2, "a wgmma prefill stage does not fit twice in shared memory");
  static_assert(kGroups == 2 || kGroups == 4, "QMOE_WG_GROUPS: 2 or 4");
};
// The stages of the FC1 / FC2 kernels (named in their launch bounds).
template <int GATE, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int BR>
using Fc1Stage = WgStage<B1, ScaleT, BLOCK, Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED), BR>;
template <typename ScaleT, int B2, int Z2, int BLOCK, int BR>
using Fc2Stage = WgStage<B2, ScaleT, BLOCK, Z2 == ZP_PACKED, BR>;

// acc (lane (g, t) of warp w: rows 16w + g / + 8, routes 8j + 2t (+1)) = W[lane rows] · act[tile routes]ᵀ
// over chunks [c0, c1) of K (128 values each), for the tile's first NR routes (NR <= BR: the MMAs' N; a tile that holds no
// more routes than NR copies and multiplies only those, acc[NR / 2 ..] stay untouched). Route row i of
// the tile starts at src + s_row[i] (an element offset); padding rows (past the tile's routes) repeat its last route, whose extra
// columns are never stored.
template <typename T, int B, int BR, int NR, bool ZPW, class QA, class QB, class St>
__device__ __forceinline__ void wg_mainloop(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, 1>& lr, i32 e,
                                            const T* src, const u32* s_row, i32 K, i32 c0, i32 c1,
                                            float (&acc_br)[BR / 2], u8* smem, Stamps& st) {
  constexpr int kThreads = St::kThreads;
  static_assert(NR <= BR && NR * 16 % kThreads == 0, "MMA routes: a route tile's 16-byte units spread evenly");
  float(&acc)[NR / 2] = reinterpret_cast<float(&)[NR / 2]>(acc_br);
  constexpr int CB = St::kCB, S = St::kStages;
  constexpr bool kScaled = QA::kBlock != 0;
  constexpr int NSB = MetaLayout<typename QA::Scale, QA::kBlock, ZPW>::NSB;
  using D = MmaDeq<T, B, QA::kZp>;
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
  const i32 nch = c1 - c0;
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  const i64 sba = LaneMeta<QA, ZPW>::base(qa, e, lr.na[0]), sbb = LaneMeta<QB, ZPW>::base(qb, e, lr.nb[0]);

  // A thread's activation units of a chunk: unit u of route rows r0 + q·kRowStep (NR rows × 16 units of 16
  // bytes spread over the block), where they start in chunk 0 (xrow, read from s_row once here: loaded
  // before each copy, ptxas put predicated-off shared loads ahead of every one) and their place in a stage
  // (xoff + q·kRowStep rows: the swizzle's row bits r & 7 are the same for every q).
  constexpr int NQ = NR * 16 / kThreads, kRowStep = kThreads / 16;
  static_assert(kRowStep % 8 == 0, "a unit keeps its swizzle from row to row");
  const int u = threadIdx.x & 15, r0 = threadIdx.x >> 4;
  const u32 xoff = (u >> 3) * (BR * 128) + r0 * 128 + (((u & 7) ^ (r0 & 7)) << 4);
  u32 xrow[NQ];
#pragma unroll
  for (int q = 0; q < NQ; ++q) xrow[q] = s_row[r0 + q * kRowStep] + u * 8;

  auto issue = [&](i32 slot, i32 c) {
    const u32 base = s0 + slot * St::kBytes;
#pragma unroll
    for (int q = 0; q < NQ; ++q) cp_async(base + xoff + q * kRowStep * 128, src + (xrow[q] + c * 128), 16, true);
    const u32 wbase = base + St::kXBytes + warp * St::kWarpBytes;
    const i32 k0 = c * 128 + 32 * t;
    const bool live = k0 < K;
    const i64 off = live ? CodeRows<B>::seg(k0 / 32) : 0;
    const i32 j = live ? QA::block_of(k0) : 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u8* p = (r ? lr.pb[0] : lr.pa[0]) + off;
      const u32 dst = wbase + (r * 32 + lane) * CB;
      cp_async_codes<CB>(dst, p, live);
      if constexpr (kScaled) {
        const u32 meta = wbase + St::kWarpCodes + (r * St::kWords) * 128 + LaneMeta<QA, ZPW>::lane_bytes(lane);
        if (r) LaneMeta<QB, ZPW>::issue(qb, sbb, e, lr.nb[0], j, meta, live, lr.pa[0]);
        else LaneMeta<QA, ZPW>::issue(qa, sba, e, lr.na[0], j, meta, live, lr.pa[0]);
      }
    }
  };

  auto compute = [&](i32 slot, i32 c) {
    const u32 xs = s0 + slot * St::kBytes;
    const u8* wst = smem + slot * St::kBytes + St::kXBytes + warp * St::kWarpBytes;
    const i32 k0 = c * 128 + 32 * t;
    const bool live = k0 < K;  // lanes past K hold zero-filled codes; their pairs are exact zeros
    const i32 j0 = live ? QA::block_of(k0) : 0;
    u32 ra[B], rb[B];
    lds_codes<B>(wst + lane * CB, ra);
    lds_codes<B>(wst + (32 + lane) * CB, rb);
    Coef ca[NSB], cb[NSB];
#pragma unroll
    for (int h = 0; h < NSB; ++h) {
      if constexpr (kScaled) {
        const u32* ma = reinterpret_cast<const u32*>(wst + St::kWarpCodes + LaneMeta<QA, ZPW>::lane_bytes(lane));
        const u32* mb = ma + St::kWords * 32;
        ca[h] = live ? D::coef(LaneMeta<QA, ZPW>::decode(qa, ma, sba, e, lr.na[0], j0, h)) : D::zero();
        cb[h] = live ? D::coef(LaneMeta<QB, ZPW>::decode(qb, mb, sbb, e, lr.nb[0], j0, h)) : D::zero();
      } else {
        ca[h] = live ? lr.rca[0] : D::zero();
        cb[h] = live ? lr.rcb[0] : D::zero();
      }
    }
    u32 a[kWgInflight + 1][4];
    const u64 desc = smem_desc(xs);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      u32(&f)[4] = a[s % (kWgInflight + 1)];
      D::template fragment<kScaled, NSB>(f, ra, rb, ca, cb, s);
      wgmma_hold(acc);
      wgmma_fence();
      Wgmma<T, NR>::mma(acc, f, desc + smem_desc_step<BR>(s));
      wgmma_commit();
      wgmma_wait<kWgInflight>();  // the MMA of step s - kWgInflight is done: its A buffer may be rewritten
      wgmma_hold(acc);
    }
    if constexpr (S == 2) {
      wgmma_wait<0>();  // this stage's shared memory is refilled after the next barrier
      wgmma_hold(acc);
    }
  };

  constexpr int A = S >= 3 ? S - 2 : 1;  // chunks the copies run ahead
#pragma unroll
  for (int i = 0; i < A; ++i) {
    if (i < nch) issue(i, c0 + i);
    cp_async_commit();
  }
  st.loop_start();
  for (i32 c = 0; c < nch; ++c) {  // the c-th chunk of the range: chunk c0 + c of K
    st.wait_start();
    cp_async_wait<A - 1>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async data, read by the async proxy
    __syncthreads();  // every thread's copies of chunk c landed; every MMA of chunk c - 2 is done
    st.wait_end();
    const i32 cn = c + A;
    if (cn < nch) issue(cn % S, c0 + cn);
    cp_async_commit();
    compute(c % S, c0 + c);
  }
  wgmma_wait<0>();
  wgmma_hold(acc);
  cp_async_wait<0>();
  st.loop_end();
}

// The main loop with the fewest MMA routes that hold the tile's `routes`: BR, BR / 2 or BR / 4 (BR / 4 from
// QMOE_WG_SHRINK 2; at least 32 routes, 16 with 3 where a block has 256 threads). An expert's last route tile
// is rarely full (at a few hundred tokens nearly empty). Each width is a copy of the main loop (compile time);
// without BR / 4 the layer measured up to 4 % slower (docs/performance-log.md, session 24); 16 routes took
// 3.5-4.5 % off gpt-oss-120b at 512 tokens, ~16 routes an expert (session 27).
#ifndef QMOE_WG_SHRINK
#define QMOE_WG_SHRINK 3
#endif
template <typename T, int B, int BR, bool ZPW, class QA, class QB, class St>
__device__ __forceinline__ void wg_tile(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, 1>& lr, i32 e,
                                        const T* src, const u32* s_row, i32 routes, i32 K, i32 c0, i32 c1,
                                        float (&acc)[BR / 2], u8* smem, Stamps& st) {
  static_assert(QMOE_WG_SHRINK >= 1 && QMOE_WG_SHRINK <= 3, "QMOE_WG_SHRINK: 1 (BR / 2), 2 (and BR / 4), 3 (to 16)");
  constexpr int kLeast = QMOE_WG_SHRINK == 3 && 16 * 16 % St::kThreads == 0 ? 16 : 32;  // the fewest MMA routes
  constexpr int kHalf = BR / 2 >= kLeast ? BR / 2 : BR;
  constexpr int kQuarter = QMOE_WG_SHRINK >= 2 && BR / 4 >= kLeast ? BR / 4 : kHalf;
  if (kQuarter < kHalf && routes <= kQuarter)
    wg_mainloop<T, B, BR, kQuarter, ZPW, QA, QB, St>(qa, qb, lr, e, src, s_row, K, c0, c1, acc, smem, st);
  else if (kHalf < BR && routes <= kHalf)
    wg_mainloop<T, B, BR, kHalf, ZPW, QA, QB, St>(qa, qb, lr, e, src, s_row, K, c0, c1, acc, smem, st);
  else
    wg_mainloop<T, B, BR, BR, ZPW, QA, QB, St>(qa, qb, lr, e, src, s_row, K, c0, c1, acc, smem, st);
}

// After group_by_expert, once a call: xp (x in the chunks' wgmma order; y zeroed for a split FC2) and the
// tile table of `slots` route tiles of BR routes (engines/wg_tiles.cuh); grid-stride, 256 threads a block.
template <typename T, int B>
__global__ void __launch_bounds__(256) wg_prepare(const T* __restrict__ x, i32 rows, i32 H, i32 Hp, T* __restrict__ xp,
                                                  float* __restrict__ y, i64 y_zero, const RouteGroups rg, i32 E, i32 BR,
                                                  i32 slots, i32* __restrict__ tile_info, i32* __restrict__ tile_rows) {
  build_tile_table(rg, E, BR, slots, (i64)blockIdx.x * 256 + threadIdx.x, (i64)gridDim.x * 256, tile_info, tile_rows);
  wg_permute_rows<T, B>(x, rows, H, Hp, xp, y, y_zero);
}

// FC1 (+FC3) with the activation fused: act_sorted[m, wg_pos<B2>(o)] for the tile's routes (B2: FC2's
// bits, whose order FC2 reads), zeros for I <= o < Ip. Warp tile = 8 outputs (gated) or 16 (plain).
template <int GATE, typename T, typename ScaleT, int B1, int B2, int Z1, int Z3, int BLOCK, int ACT, int BR>
__global__ void __launch_bounds__(Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>::kThreads,
                                  Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>::kMinBlocks)
fc1_wgmma(const T* __restrict__ xp, const RouteGroups rg, const i32* __restrict__ tile_info, const i32* __restrict__ tile_rows,
          i32 E, i32 k, i32 H, i32 Hp, i32 I, i32 Ip, i32 NT, i32 G, const Fc1Weights<ScaleT> wt, const ActParams ap,
          T* __restrict__ act_sorted) {
  using Rows = Fc1Rows<GATE>;
  constexpr bool kZpw = Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED);
  using St = Fc1Stage<GATE, ScaleT, B1, Z1, Z3, BLOCK, BR>;
  constexpr int kOut = Rows::kGated ? 8 : 16;
  Stamps st;
  st.start();
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ u32 s_row[BR];  // element offsets of the tile's route rows in xp (< 2^32: the host's bound)
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  i32 nt, e, m0, m_end, route[(BR + St::kThreads - 1) / St::kThreads];
  if (!pf_tile_table<BR, St::kThreads>((i32)blockIdx.x, rg.sorted, rg.offsets, rg.tile_offsets, E, NT, G, tile_info,
                                       tile_rows, nt, e, m0, m_end, route))
    return;
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
#pragma unroll
  for (int q = 0; q < (BR + St::kThreads - 1) / St::kThreads; ++q)
    if (threadIdx.x + q * St::kThreads < BR) s_row[threadIdx.x + q * St::kThreads] = (u32)(route[q] / k) * (u32)Hp;
  __syncthreads();
  float acc[BR / 2];
#pragma unroll
  for (int i = 0; i < BR / 2; ++i) acc[i] = 0.0f;
  wg_tile<T, B1, BR, kZpw, Q1, QB, St>(q1, qb, lr, e, xp, s_row, m_end - m0, H, 0, Hp / 128, acc, smem, st);
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
      const float ha = acc[4 * jn + cc] * lr.sa[0], hb = acc[4 * jn + 2 + cc] * lr.sb[0];  // rows g, g + 8
      T* out = act_sorted + (i64)pos * Ip;
      if constexpr (Rows::kGated) {
        if (o < Ip) out[wg_pos<B2>(o)] = Traits<T>::from_float(o < I ? fc1_apply<ACT, GATE>(ha, hb, ba, ap) : 0.0f);
      } else {
        if (o < Ip) out[wg_pos<B2>(o)] = Traits<T>::from_float(o < I ? fc1_apply<ACT, GATE>(ha, 0.0f, ba, ap) : 0.0f);
        if (o + 8 < Ip)
          out[wg_pos<B2>(o + 8)] = Traits<T>::from_float(o + 8 < I ? fc1_apply<ACT, GATE>(hb, 0.0f, bb, ap) : 0.0f);
      }
    }
  }
  st.store(0, Hp / 128);
}

// Whether FC2 splits K in two this call (KS = 2: the host launched two blocks a tile, zeroed y, and K has
// 32 chunks or more): when V tiles on P SMs leave the last round of whole tiles at most half full, so
// that halves take an odd number of half rounds, and at most three (measured on the H200, session 22:
// mixtral-8x7b at 512 tokens, V = 1.45 P, -7.8 %; at 1024, 2.4 P, +1.3 %; ort-2048 at 1024 / 2048
// tokens, 16 chunks, +3 % / +10 %). The same for every tile of the call, so a route's sum has the same
// form whichever tile it lands in.
__device__ __forceinline__ bool fc2_splits(i32 KS, i32 V, i32 P) {
  const i32 halves = (2 * V + P - 1) / P;  // rounds of half tiles
  return KS == 2 && (halves == 1 || halves == 3);
}

// FC2: y[route, n] = act_sorted[m] · W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
// KS = 2: blocks 2i, 2i + 1 are tile i's halves of K; when fc2_splits, each adds its half into y (zeroed
// by wg_prepare), the first half with the bias: y = (0 + lo·s + b) + hi·s in either order, one value.
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__global__ void __launch_bounds__(Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>::kThreads,
                                  Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>::kMinBlocks)
fc2_wgmma(const T* __restrict__ act_sorted, const RouteGroups rg, const i32* __restrict__ tile_info,
          const i32* __restrict__ tile_rows, i32 E, i32 H, i32 I, i32 Ip, i32 NT, i32 G, i32 KS, i32 SMS,
          const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  using St = Fc2Stage<ScaleT, B2, Z2, BLOCK, BR>;
  constexpr bool kZpw = Z2 == ZP_PACKED;
  Stamps st;
  st.start();
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ u32 s_row[BR];  // element offsets of the tile's rows in act_sorted (< 2^32: the host's bound)
  __shared__ i32 s_route[BR];
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  // whole tiles: the even blocks (only odd ones read the count here, the others' first loads are their tile's)
  if (blockIdx.x % KS && !fc2_splits(KS, rg.tile_offsets[E] * NT, SMS)) return;
  i32 nt, e, m0, m_end, route[(BR + St::kThreads - 1) / St::kThreads];
  if (!pf_tile_table<BR, St::kThreads>((i32)blockIdx.x / KS, rg.sorted, rg.offsets, rg.tile_offsets, E, NT, G, tile_info,
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
  float acc[BR / 2];
#pragma unroll
  for (int i = 0; i < BR / 2; ++i) acc[i] = 0.0f;
  {
    const bool split = fc2_splits(KS, rg.tile_offsets[E] * NT, SMS), half = blockIdx.x % KS;
    const i32 nch = Ip / 128, c0 = split && half ? nch / 2 : 0, c1 = split && !half ? nch / 2 : nch;
    wg_tile<T, B2, BR, kZpw, Q2, Q2, St>(q2, q2, lr, e, act_sorted, s_row, m_end - m0, I, c0, c1, acc, smem, st);
  }
  // After the main loop, what is the same for the whole block is read again rather than held in
  // registers across it. A thread's rows n, n + 8 are the same for every route of the tile: their biases
  // are read once (the second half of a split adds none).
  const bool split = fc2_splits(KS, rg.tile_offsets[E] * NT, SMS), half = blockIdx.x % KS;
  const i32 n = n0 + g;
  const bool bias = p2.bias && !half;
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
      if (split) {
        if (n < H) atomicAdd(out + n, va);
        if (n + 8 < H) atomicAdd(out + n + 8, vb);
      } else {
        if (n < H) out[n] = va;
        if (n + 8 < H) out[n + 8] = vb;
      }
    }
  }
  st.store(1, split ? (half ? Ip / 128 - Ip / 256 : Ip / 256) : Ip / 128);
}

}  // namespace qmoe
