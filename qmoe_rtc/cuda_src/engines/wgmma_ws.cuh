// engines/wgmma_ws.cuh: the Hopper prefill engine, warp-specialised and persistent (sm_90a): the grouped
// GEMMs of engines/wgmma_prefill.cuh (same arguments, same layouts, same exact dequantization) with the
// copies and the MMAs in different warps.
//
//   sorted, offsets, tile_offsets     routing/group.cuh, route tiles of BR routes (64 or 128)
//   xp          [rows, Hp]  T     the input in wgmma K order (core/wg_order.cuh), zeros past H
//   act_sorted  [R, Ip]     T     FC1 out in sorted order, in FC2's wgmma order (zeros past I)
//   y           [R, H]      f32   FC2 out by route id, bias added (the combine applies the routing weight)
//
// Block: kWsConsumers MMA warpgroups + one copy warpgroup, one block per SM walking the tile list
// (pf_tile_at: G route tiles of a weight tile, then the next weight tile) with a stride of the grid.
//   copy warpgroup   issues every cp.async of a stage: the route tile's activations (128-byte swizzle,
//                    route rows gathered by index) and each MMA lane's codes and scale words, then
//                    cp_async_arrive on the stage's `full` barrier; waits on its `empty` barrier before
//                    refilling it. It gives its registers to the MMA warps (setmaxnreg).
//   MMA warp w       kWsMW m16 weight tiles (tile w·MW + m: rows g and g + 8 of the tile, the lane
//                    layout of the other tensor-core engines), one m64nBRk16 MMA per tile and k16 step,
//                    A dequantized in registers, B the stage's route tile; acc[MW][BR / 2] f32.
// The ring of St::kStages stages runs across tiles, so the next tile's first chunks are copied while
// the MMA warps finish a tile and store it. A stage is released when the MMAs that read it are done
// (the wait of the next chunk's first step).
#pragma once

#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/experts.cuh"
#include "core/lane_meta.cuh"
#include "core/mbarrier.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "core/wg_order.cuh"
#include "core/wgmma.cuh"
#include "engines/tile_rows.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "routing/group.cuh"

namespace qmoe {

#ifndef QMOE_WS_CONSUMERS
#define QMOE_WS_CONSUMERS 2
#endif
#ifndef QMOE_WS_MW
#define QMOE_WS_MW 2
#endif
#ifndef QMOE_WS_STAGES
#define QMOE_WS_STAGES 4
#endif
#ifndef QMOE_WS_INFLIGHT
#define QMOE_WS_INFLIGHT 1
#endif
inline constexpr int kWsConsumers = QMOE_WS_CONSUMERS;  // MMA warpgroups per block
inline constexpr int kWsMW = QMOE_WS_MW;                // m16 weight tiles per MMA warp
inline constexpr int kWsWarps = 4 * kWsConsumers;       // MMA warps
inline constexpr int kWsTiles = kWsWarps * kWsMW;       // m16 weight tiles per block
inline constexpr int kWsMmaThreads = 128 * kWsConsumers;
inline constexpr int kWsThreads = kWsMmaThreads + 128;  // + the copy warpgroup
inline constexpr int kWsMaxStages = QMOE_WS_STAGES;
inline constexpr int kWsInflight = QMOE_WS_INFLIGHT;    // k16 steps of MMAs in flight per warpgroup
static_assert(kWsInflight == 1 || kWsInflight == 2, "QMOE_WS_INFLIGHT must be 1 or 2");
static_assert(kWsConsumers == 1 || kWsConsumers == 2, "QMOE_WS_CONSUMERS must be 1 or 2");
// Registers: the launch gives every thread the 64K / kWsThreads the launch bounds allow (rounded down to
// 8); the copy warpgroup keeps kWsCopyRegs and the MMA warpgroups share the rest.
inline constexpr int kWsLaunchRegs = (65536 / kWsThreads) / 8 * 8 > 255 ? 248 : (65536 / kWsThreads) / 8 * 8;
inline constexpr int kWsCopyRegs = 56;
inline constexpr int kWsMmaRegsRaw = (kWsLaunchRegs * kWsThreads - 128 * kWsCopyRegs) / kWsMmaThreads / 8 * 8;
inline constexpr int kWsMmaRegs = kWsMmaRegsRaw > 240 ? 240 : kWsMmaRegsRaw;
// dynamic bytes for the stages: 227 KB less the alignment slack and 3 KB of static shared memory (barriers,
// the copy warpgroup's route rows: 2 KB at BR = 256)
inline constexpr int kWsSmemBudget = 227 * 1024 - 1024 - 3072;

// One stage (1024-aligned, in dynamic shared memory):
//   x     [2 halves][BR][128 B]               logical k 0..63 / 64..127 of the tile's routes, 128-byte
//                                             swizzle (unit u of row r at u ^ (r & 7))
//   then per m16 weight tile (kWsTiles):
//     codes [2 rows][32 lanes][4·B B]         each lane's 32 codes of its two rows
//     meta  [2 rows][kWords][32] u32          their scale / zp words or records (block-wise scales)
template <int B, typename ScaleT, int BLOCK, bool ZPW, int BR> struct WsStage {
  static constexpr int kXBytes = BR * 256;
  static constexpr int kWords = BLOCK ? MetaLayout<ScaleT, BLOCK, ZPW, B>::kWords : 0;
  static constexpr int kCB = 4 * B;
  static constexpr int kTileCodes = 2 * 32 * kCB;
  static constexpr int kTileBytes = kTileCodes + 2 * kWords * 128;
  static constexpr int kBytes = (kXBytes + kWsTiles * kTileBytes + 1023) / 1024 * 1024;
  static constexpr int kStages = kWsSmemBudget / kBytes < kWsMaxStages ? kWsSmemBudget / kBytes : kWsMaxStages;
  static_assert(kStages >= 2, "a warp-specialised wgmma stage does not fit twice in shared memory");
};

template <int R> __device__ __forceinline__ void ws_regs_dec() {
#if QMOE_HAVE_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
#endif
}
template <int R> __device__ __forceinline__ void ws_regs_inc() {
#if QMOE_HAVE_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
#endif
}

// The ring's position: `it` counts the stages handed over since the kernel started (slot it % S, the
// slot's use it / S, whose parity the barriers' phases follow).
template <int S> struct WsRing {
  u32 full, empty;  // shared addresses of the barriers: full[S], empty[S] (8 bytes each)
  u32 it = 0;
  __device__ __forceinline__ u32 slot() const { return it % S; }
  __device__ __forceinline__ u32 parity() const { return (it / S) & 1u; }
  __device__ __forceinline__ u32 full_at(u32 s) const { return full + 8 * s; }
  __device__ __forceinline__ u32 empty_at(u32 s) const { return empty + 8 * s; }
};

// Lane rows of weight tile wt (m16 tiles counted over the whole projection) for lane group g: the rows
// a lane reads (na, nb) and their tile rows (ma, mb; core/codes.cuh). FC1: 8 gated or 16 plain outputs
// per tile; FC2: 16 rows. Rows past the end are clamped (their results are never stored).
struct WsRow {
  i32 na, ma, nb, mb;
};
template <int GATE> __device__ __forceinline__ WsRow ws_fc1_row(i32 wt, i32 g, i32 I) {
  using Rows = Fc1Rows<GATE>;
  const i32 o0 = wt * (Rows::kGated ? 8 : 16);
  const i32 oa = min(o0 + g, I - 1), ob = Rows::kGated ? oa : min(o0 + g + 8, I - 1);
  const i32 na = Rows::gate_row(oa, I), nb = Rows::kGated ? Rows::lin_row(oa, I) : ob;
  return {na, Rows::tile_row(na), nb, Rows::tile_row(nb)};
}
__device__ __forceinline__ WsRow ws_fc2_row(i32 wt, i32 g, i32 H) {
  const i32 na = min(wt * 16 + g, H - 1), nb = min(wt * 16 + g + 8, H - 1);
  return {na, na, nb, nb};
}

// The copy warpgroup's share of one tile: every chunk of K into the ring. Thread (pw, lane) copies the
// route rows' units i ≡ its index (mod 128) and, for MMA warps pw·C .. pw·C + C - 1, lane `lane`'s codes
// and meta of each of their tiles. Route row i of the tile is row s_src[i] of src (rows of Kp values;
// < 0: padding, zeros).
template <typename T, int B, int BR, bool ZPW, class QA, class QB, class St, class RowOf>
__device__ __forceinline__ void ws_produce(const QA& qa, const QB& qb, const u8* wa, const u8* wb, i32 e, i32 nt,
                                           const RowOf& row_of, const T* __restrict__ src, const i32* s_src, i32 K,
                                           i32 Kp, u32 s0, WsRing<St::kStages>& ring) {
  constexpr int CB = St::kCB;
  constexpr bool kScaled = QA::kBlock != 0;
  const i32 pt = threadIdx.x - kWsMmaThreads, lane = pt & 31, pw = pt >> 5, g = lane >> 2, t = lane & 3;
  const i32 nch = Kp / 128;
  for (i32 c = 0; c < nch; ++c) {
    const u32 slot = ring.slot();
    mbar_wait(ring.empty_at(slot), ring.parity() ^ 1u);
    const u32 base = s0 + slot * St::kBytes;
    for (int i = pt; i < BR * 16; i += 128) {
      const int r = i >> 4, u = i & 15;
      const i32 so = s_src[r];
      const u32 dst = base + (u >> 3) * (BR * 128) + r * 128 + (((u & 7) ^ (r & 7)) << 4);
      cp_async(dst, so >= 0 ? src + (i64)so * Kp + c * 128 + u * 8 : src, 16, so >= 0);
    }
    const i32 k0 = c * 128 + 32 * t;
    const bool live = k0 < K;
    const i64 off = live ? CodeRows<B>::seg(k0 / 32) : 0;
    const i32 j = live ? QA::block_of(k0) : 0;
#pragma unroll 1
    for (int q = 0; q < kWsConsumers * kWsMW; ++q) {  // the tiles of MMA warps pw·C .. pw·C + C - 1
      {
        const i32 tl = pw * kWsConsumers * kWsMW + q;
        const WsRow rw = row_of(nt * kWsTiles + tl, g);
        const u32 tb = base + St::kXBytes + tl * St::kTileBytes;
        cp_async_codes<CB>(tb + lane * CB, wa + CodeRows<B>::row(e, qa.N, rw.ma, qa.K) + off, live);
        cp_async_codes<CB>(tb + (32 + lane) * CB, wb + CodeRows<B>::row(e, qb.N, rw.mb, qb.K) + off, live);
        if constexpr (kScaled) {
          const u32 meta = tb + St::kTileCodes + LaneMeta<QA, ZPW>::lane_bytes(lane);
          LaneMeta<QA, ZPW>::issue(qa, LaneMeta<QA, ZPW>::base(qa, e, rw.na), e, rw.na, j, meta, live, wa);
          LaneMeta<QB, ZPW>::issue(qb, LaneMeta<QB, ZPW>::base(qb, e, rw.nb), e, rw.nb, j, meta + St::kWords * 128,
                                   live, wa);
        }
      }
    }
    cp_async_arrive(ring.full_at(slot));
    ++ring.it;
  }
}

// An MMA warp's share of one tile: acc[m] (lane (g, t): rows g / g + 8 of tile m, routes 8j + 2t (+1))
// = W[lane rows] · act[tile routes]ᵀ over K. `held`: the slot whose MMAs may still run (-1: none),
// released once they are done.
template <typename T, int B, int BR, bool ZPW, class QA, class QB, class St>
__device__ __forceinline__ void ws_consume(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, kWsMW>& lr, i32 e,
                                           i32 K, i32 Kp, float (&acc)[kWsMW][BR / 2], u8* smem, u32 s0,
                                           WsRing<St::kStages>& ring, i32& held) {
  constexpr int CB = St::kCB;
  constexpr bool kScaled = QA::kBlock != 0;
  constexpr int NSB = MetaLayout<typename QA::Scale, QA::kBlock, ZPW>::NSB;
  using D = MmaDeq<T, B, QA::kZp == ZP_FP8>;
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
  const i32 nch = Kp / 128;
  i64 sba[kWsMW], sbb[kWsMW];
#pragma unroll
  for (int m = 0; m < kWsMW; ++m) {
    sba[m] = LaneMeta<QA, ZPW>::base(qa, e, lr.na[m]);
    sbb[m] = LaneMeta<QB, ZPW>::base(qb, e, lr.nb[m]);
  }
  for (i32 c = 0; c < nch; ++c) {
    const u32 slot = ring.slot();
    mbar_wait(ring.full_at(slot), ring.parity());
    fence_async_shared();
    const u32 xs = s0 + slot * St::kBytes;
    const i32 k0 = c * 128 + 32 * t;
    const bool live = k0 < K;  // lanes past K hold zero-filled codes; their pairs are exact zeros
    const i32 j0 = live ? QA::block_of(k0) : 0;
    u32 ra[kWsMW][B], rb[kWsMW][B];
    Coef ca[kWsMW][NSB], cb[kWsMW][NSB];
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const u8* wst = smem + slot * St::kBytes + St::kXBytes + (warp * kWsMW + m) * St::kTileBytes;
      lds_codes<B>(wst + lane * CB, ra[m]);
      lds_codes<B>(wst + (32 + lane) * CB, rb[m]);
#pragma unroll
      for (int h = 0; h < NSB; ++h) {
        if constexpr (kScaled) {
          const u32* ma = reinterpret_cast<const u32*>(wst + St::kTileCodes + LaneMeta<QA, ZPW>::lane_bytes(lane));
          const u32* mb = ma + St::kWords * 32;
          ca[m][h] = live ? D::coef(LaneMeta<QA, ZPW>::decode(qa, ma, sba[m], e, lr.na[m], j0, h)) : D::zero();
          cb[m][h] = live ? D::coef(LaneMeta<QB, ZPW>::decode(qb, mb, sbb[m], e, lr.nb[m], j0, h)) : D::zero();
        } else {
          ca[m][h] = live ? lr.rca[m] : D::zero();
          cb[m][h] = live ? lr.rcb[m] : D::zero();
        }
      }
    }
    u32 a[kWsInflight + 1][kWsMW][4];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int h0 = NSB == 2 ? D::low_code(2 * s) / 16 : 0, h1 = NSB == 2 ? D::low_code(2 * s + 1) / 16 : 0;
#pragma unroll
      for (int m = 0; m < kWsMW; ++m) {
        u32(&f)[4] = a[s % (kWsInflight + 1)][m];
        f[0] = D::template pair<kScaled>(ra[m], 2 * s, ca[m][h0]);
        f[1] = D::template pair<kScaled>(rb[m], 2 * s, cb[m][h0]);
        f[2] = D::template pair<kScaled>(ra[m], 2 * s + 1, ca[m][h1]);
        f[3] = D::template pair<kScaled>(rb[m], 2 * s + 1, cb[m][h1]);
      }
#pragma unroll
      for (int m = 0; m < kWsMW; ++m) wgmma_hold(acc[m]);
      wgmma_fence();
#pragma unroll
      for (int m = 0; m < kWsMW; ++m)
        Wgmma<T, BR>::mma(acc[m], a[s % (kWsInflight + 1)][m], smem_desc(xs + (s >> 2) * (BR * 128) + (s & 3) * 32));
      wgmma_commit();
      wgmma_wait<kWsInflight>();  // step s - kWsInflight is done: its A buffers may be rewritten
#pragma unroll
      for (int m = 0; m < kWsMW; ++m) wgmma_hold(acc[m]);
      if (s == kWsInflight - 1) {  // every MMA of the previous chunk is done (lanes converged by the wait)
        mbar_arrive_if(ring.empty_at(held >= 0 ? (u32)held : 0u), lane == 0 && held >= 0);
        held = -1;
      }
    }
    held = (i32)slot;
    ++ring.it;
  }
  wgmma_wait<0>();
#pragma unroll
  for (int m = 0; m < kWsMW; ++m) wgmma_hold(acc[m]);
  mbar_arrive_if(ring.empty_at(held >= 0 ? (u32)held : 0u), lane == 0 && held >= 0);
  held = -1;
}

// Barriers and the ring's start: full[s] counts the copy warpgroup's 128 threads, empty[s] the MMA warps.
template <int S> __device__ __forceinline__ WsRing<S> ws_ring(u64* bars) {
  WsRing<S> ring;
  ring.full = (u32)__cvta_generic_to_shared(bars);
  ring.empty = ring.full + 8 * S;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(ring.full_at(s), 128);
      mbar_init(ring.empty_at(s), kWsWarps);
    }
  }
  __syncthreads();
  return ring;
}

// FC1 (+FC3) with the activation fused: act_sorted[m, wg_pos<B2>(o)] for the tile's routes (B2: FC2's
// bits, whose order FC2 reads), zeros for I <= o < Ip. Weight tile = 8 outputs (gated) or 16 (plain).
template <int GATE, typename T, typename ScaleT, int B1, int B2, int Z1, int Z3, int BLOCK, int ACT, int BR>
__global__ void __launch_bounds__(kWsThreads, 1)
fc1_wgws(const T* __restrict__ xp, const i32* __restrict__ sorted, const i32* __restrict__ offsets,
         const i32* __restrict__ tile_offsets, i32 E, i32 k, i32 H, i32 Hp, i32 I, i32 Ip, i32 NT, i32 G,
         const u8* __restrict__ w1, const ScaleT* __restrict__ s1, const u8* __restrict__ z1,
         const float* __restrict__ b1, const u8* __restrict__ w3, const ScaleT* __restrict__ s3,
         const u8* __restrict__ z3, const float* __restrict__ b3, i32 E_routed, const u8* __restrict__ shared_w1,
         const ScaleT* __restrict__ shared_s1, const u8* __restrict__ shared_z1, const float* __restrict__ shared_b1,
         float zp_offset, float alpha, float beta, float limit, i32 limit_after, T* __restrict__ act_sorted) {
  using Rows = Fc1Rows<GATE>;
  constexpr bool kZpw = Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED);
  using St = WsStage<B1, ScaleT, BLOCK, kZpw, BR>;
  using Q1 = QuantParams<ScaleT, B1, BLOCK, Z1>;
  using Q3 = QuantParams<ScaleT, B1, BLOCK, Z3>;
  using Second = PfSecond<GATE == GATE_FC3, Q1, Q3>;
  using QB = typename Second::type;
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ __align__(8) u64 bars[2 * St::kStages];
  __shared__ i32 s_src[2][BR];
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  WsRing<St::kStages> ring = ws_ring<St::kStages>(bars);
  const i32 total = pf_tile_count(tile_offsets, E, NT, G);
  auto row_of = [I](i32 wt, i32 g) { return ws_fc1_row<GATE>(wt, g, I); };

  if (threadIdx.x >= kWsMmaThreads) {  // the copy warpgroup
    ws_regs_dec<kWsCopyRegs>();
    const i32 pt = threadIdx.x - kWsMmaThreads;
    i32 n = 0;
    for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
      i32 nt, e, m0, m_end;
      if (!pf_tile_at<BR>(idx, offsets, tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
      const u8* w = w1;
      const ScaleT* s = s1;
      const u8* z = z1;
      const float* b = b1;
      pick_expert(e, E_routed, w, s, z, b, shared_w1, shared_s1, shared_z1, shared_b1);
      const Q1 q1{s, z, zp_offset, Rows::n1(I), H, Rows::kInterleavedTiles};
      const Q3 q3{s3, z3, zp_offset, I, H};
      i32* ss = s_src[n & 1];
      for (int i = pt; i < BR; i += 128) ss[i] = m0 + i < m_end ? sorted[m0 + i] / k : -1;
      named_sync(1, 128);
      ws_produce<T, B1, BR, kZpw, Q1, QB, St>(q1, Second::pick(q1, q3), w, GATE == GATE_FC3 ? w3 : w, e, nt,
                                                    row_of, xp, ss, H, Hp, s0, ring);
      ++n;
    }
    cp_async_wait<0>();
    return;
  }

  ws_regs_inc<kWsMmaRegs>();
  const ActParams ap{alpha, beta, limit, limit_after};
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  i32 held = -1;
  for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
    i32 nt, e, m0, m_end;
    if (!pf_tile_at<BR>(idx, offsets, tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
    const u8* w = w1;
    const ScaleT* s = s1;
    const u8* z = z1;
    const float* b = b1;
    pick_expert(e, E_routed, w, s, z, b, shared_w1, shared_s1, shared_z1, shared_b1);
    const Q1 q1{s, z, zp_offset, Rows::n1(I), H, Rows::kInterleavedTiles};
    const Q3 q3{s3, z3, zp_offset, I, H};
    const QB& qb = Second::pick(q1, q3);
    const u8* wb = GATE == GATE_FC3 ? w3 : w;
    PfLaneRows<T, Q1, QB, kWsMW> lr;
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const WsRow rw = row_of(nt * kWsTiles + warp * kWsMW + m, g);
      lr.set(m, q1, w, rw.na, rw.ma, qb, wb, rw.nb, rw.mb, e);
    }
    float acc[kWsMW][BR / 2];
#pragma unroll
    for (int m = 0; m < kWsMW; ++m)
#pragma unroll
      for (int i = 0; i < BR / 2; ++i) acc[m][i] = 0.0f;
    ws_consume<T, B1, BR, kZpw, Q1, QB, St>(q1, qb, lr, e, H, Hp, acc, smem, s0, ring, held);
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const i32 o = (nt * kWsTiles + warp * kWsMW + m) * (Rows::kGated ? 8 : 16) + g;
#pragma unroll
      for (int jn = 0; jn < BR / 8; ++jn) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const i32 pos = m0 + 8 * jn + 2 * t + cc;
          if (pos >= m_end) continue;
          const float ha = acc[m][4 * jn + cc] * lr.sa[m], hb = acc[m][4 * jn + 2 + cc] * lr.sb[m];  // rows g, g + 8
          T* out = act_sorted + (i64)pos * Ip;
          if constexpr (Rows::kGated) {
            if (o < Ip)
              out[wg_pos<B2>(o)] = Traits<T>::from_float(o < I ? fc1_activation<ACT, GATE>(ha, hb, b, b3, e, o, I, ap) : 0.0f);
          } else {
            if (o < Ip)
              out[wg_pos<B2>(o)] = Traits<T>::from_float(o < I ? fc1_activation<ACT, GATE>(ha, 0.0f, b, b3, e, o, I, ap) : 0.0f);
            if (o + 8 < Ip)
              out[wg_pos<B2>(o + 8)] =
                  Traits<T>::from_float(o + 8 < I ? fc1_activation<ACT, GATE>(hb, 0.0f, b, b3, e, o + 8, I, ap) : 0.0f);
          }
        }
      }
    }
  }
}

// FC2: y[route, n] = act_sorted[m] · W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__global__ void __launch_bounds__(kWsThreads, 1)
fc2_wgws(const T* __restrict__ act_sorted, const i32* __restrict__ sorted, const i32* __restrict__ offsets,
         const i32* __restrict__ tile_offsets, i32 E, i32 H, i32 I, i32 Ip, i32 NT, i32 G, const u8* __restrict__ w2,
         const ScaleT* __restrict__ s2, const u8* __restrict__ z2, const float* __restrict__ b2, i32 E_routed,
         const u8* __restrict__ shared_w2, const ScaleT* __restrict__ shared_s2, const u8* __restrict__ shared_z2,
         const float* __restrict__ shared_b2, float zp_offset, float* __restrict__ y) {
  constexpr bool kZpw = Z2 == ZP_PACKED;
  using St = WsStage<B2, ScaleT, BLOCK, kZpw, BR>;
  using Q2 = QuantParams<ScaleT, B2, BLOCK, Z2>;
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ __align__(8) u64 bars[2 * St::kStages];
  __shared__ i32 s_src[2][BR];
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  WsRing<St::kStages> ring = ws_ring<St::kStages>(bars);
  const i32 total = pf_tile_count(tile_offsets, E, NT, G);
  auto row_of = [H](i32 wt, i32 g) { return ws_fc2_row(wt, g, H); };

  if (threadIdx.x >= kWsMmaThreads) {  // the copy warpgroup
    ws_regs_dec<kWsCopyRegs>();
    const i32 pt = threadIdx.x - kWsMmaThreads;
    i32 n = 0;
    for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
      i32 nt, e, m0, m_end;
      if (!pf_tile_at<BR>(idx, offsets, tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
      const u8* w = w2;
      const ScaleT* s = s2;
      const u8* z = z2;
      const float* b = b2;
      pick_expert(e, E_routed, w, s, z, b, shared_w2, shared_s2, shared_z2, shared_b2);
      const Q2 q2{s, z, zp_offset, H, I};
      i32* ss = s_src[n & 1];
      for (int i = pt; i < BR; i += 128) ss[i] = m0 + i < m_end ? m0 + i : -1;
      named_sync(1, 128);
      ws_produce<T, B2, BR, kZpw, Q2, Q2, St>(q2, q2, w, w, e, nt, row_of, act_sorted, ss, I, Ip, s0, ring);
      ++n;
    }
    cp_async_wait<0>();
    return;
  }

  ws_regs_inc<kWsMmaRegs>();
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  i32 held = -1;
  for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
    i32 nt, e, m0, m_end;
    if (!pf_tile_at<BR>(idx, offsets, tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
    const u8* w = w2;
    const ScaleT* s = s2;
    const u8* z = z2;
    const float* b = b2;
    pick_expert(e, E_routed, w, s, z, b, shared_w2, shared_s2, shared_z2, shared_b2);
    const Q2 q2{s, z, zp_offset, H, I};
    PfLaneRows<T, Q2, Q2, kWsMW> lr;
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const WsRow rw = row_of(nt * kWsTiles + warp * kWsMW + m, g);
      lr.set(m, q2, w, rw.na, rw.ma, q2, w, rw.nb, rw.mb, e);
    }
    float acc[kWsMW][BR / 2];
#pragma unroll
    for (int m = 0; m < kWsMW; ++m)
#pragma unroll
      for (int i = 0; i < BR / 2; ++i) acc[m][i] = 0.0f;
    ws_consume<T, B2, BR, kZpw, Q2, Q2, St>(q2, q2, lr, e, I, Ip, acc, smem, s0, ring, held);
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const i32 n = (nt * kWsTiles + warp * kWsMW + m) * 16 + g;
#pragma unroll
      for (int jn = 0; jn < BR / 8; ++jn) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const i32 pos = m0 + 8 * jn + 2 * t + cc;
          if (pos >= m_end) continue;
          float* out = y + (i64)sorted[pos] * H;
          if (n < H) out[n] = acc[m][4 * jn + cc] * lr.sa[m] + (b ? b[(i64)e * H + n] : 0.0f);
          if (n + 8 < H) out[n + 8] = acc[m][4 * jn + 2 + cc] * lr.sb[m] + (b ? b[(i64)e * H + n + 8] : 0.0f);
        }
      }
    }
  }
}

}  // namespace qmoe
