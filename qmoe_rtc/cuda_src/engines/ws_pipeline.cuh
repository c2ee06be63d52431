// engines/ws_pipeline.cuh: the warp-specialised ring of engines/wgmma_ws.cuh -- its geometry and register
// split, the stage layout, the barriers, and the two halves of a tile's K loop: what the copy warpgroup
// issues (ws_produce) and what an MMA warp computes (ws_consume). Only engines/wgmma_ws.cuh includes it.
#pragma once

#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/lane_meta.cuh"
#include "core/mbarrier.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "core/wgmma.cuh"
#include "engines/lane_tiles.cuh"
#include "engines/tile_rows.cuh"
#include "epilogue/fc1.cuh"

namespace qmoe {

#ifndef QMOE_WS_CONSUMERS
#define QMOE_WS_CONSUMERS 2
#endif
#ifndef QMOE_WS_MW
#define QMOE_WS_MW 1
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
// dynamic bytes for the stages, from the host (kernels/wgmma_geometry.py WS_SMEM_BUDGET): the target's opt-in limit
// per block (227 KiB) less the alignment slack and 3 KiB kept for static shared memory (the barriers take 16 bytes a stage)
#ifndef QMOE_WS_STAGE_BUDGET
#error "QMOE_WS_STAGE_BUDGET comes from the host (kernels/wgmma_prefill.py defines)"
#endif
inline constexpr int kWsSmemBudget = QMOE_WS_STAGE_BUDGET;

// One stage (1024-aligned, in dynamic shared memory):
//   x     [2 halves][BR][128 B]               logical k 0..63 / 64..127 of the tile's routes, 128-byte
//                                             swizzle (unit u of row r at u ^ (r & 7))
//   then per m16 weight tile (kWsTiles):
//     codes [2 rows][32 lanes][4·B B]         each lane's 32 codes of its two rows
//     meta  [2 rows][kWords][32] u32          their scale / zp words or records (block-wise scales)
template <int B, typename ScaleT, int BLOCK, bool ZPW, int BR> struct WsStage {
  using W = LaneTileBytes<B, ScaleT, BLOCK, ZPW, 1>;  // one tile (engines/lane_tiles.cuh)
  static constexpr int kXBytes = BR * 256;
  static constexpr int kWords = W::kWords;
  static constexpr int kCB = W::kCB;
  static constexpr int kTileCodes = W::kCodes;
  static constexpr int kTileBytes = W::kBytes;
  static constexpr int kBytes = (kXBytes + kWsTiles * kTileBytes + 1023) / 1024 * 1024;
  static constexpr int kStages = kWsSmemBudget / kBytes < kWsMaxStages ? kWsSmemBudget / kBytes : kWsMaxStages;
  static_assert(kStages >= 2, "a warp-specialised wgmma stage does not fit twice in shared memory");
  // Meta copied by runs (tiled records): a row's region holds the records of the chunk's kChunkBlocks
  // blocks, [blocks][8 lane groups][record bytes], at the same place as the lane-by-lane words.
  static constexpr int kChunkBlocks = BLOCK == 0 ? 0 : (BLOCK <= 128 ? 128 / BLOCK : 1);
  static_assert(!kTiledMetaLayout || BLOCK == 0 || kChunkBlocks * 8 * MetaLayout<ScaleT, BLOCK, ZPW, B>::kRec <= kWords * 128,
                "a chunk's meta records fit a row's meta region");
};

// Whether a projection pair is copied by runs (a row group's chunk of codes, a chunk's records: each one
// contiguous): tiled codes, and scales in tiled meta records (or row-wise).
template <class QA, class QB> struct WsRuns {
  static constexpr bool value = kTiled && (QA::kBlock == 0 || (QA::kTiledMeta && QB::kTiledMeta));
};

// Scale and zero point of lane group g's row n from a chunk's records copied as a run (`region`: the row's
// meta region; jj: the block's index in the chunk).
template <class Q> __device__ __forceinline__ ScaleZp ws_meta(const Q& q, const u8* region, i32 n, i32 g, i32 jj) {
  using ScaleT = typename Q::Scale;
  const u8* rec = region + (jj * 8 + g) * Q::kMetaBytes;
  const int half = q.meta_half(n);
  ScaleZp sz;
  sz.scale = Traits<ScaleT>::to_float(reinterpret_cast<const ScaleT*>(rec)[half]);
  sz.zp = Q::kZp == ZP_PACKED ? (float)rec[2 * sizeof(ScaleT) + half] : q.fixed_zp();
  return sz;
}

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

// The copy warpgroup's share of one tile: every chunk of K into the ring (see the header). The route
// tile is rows m0 .. m0 + BR - 1 of the image `img`.
template <typename T, int B, int BR, bool ZPW, class QA, class QB, class St, class RowOf>
__device__ __forceinline__ void ws_produce(const QA& qa, const QB& qb, const u8* wa, const u8* wb, i32 e, i32 nt, i32 m0,
                                           const RowOf& row_of, const T* __restrict__ img, i32 Rp, i32 K, i32 Kp,
                                           u32 s0, WsRing<St::kStages>& ring) {
  constexpr int CB = St::kCB;
  constexpr bool kScaled = QA::kBlock != 0;
  constexpr bool kRuns = WsRuns<QA, QB>::value;
  const i32 pt = threadIdx.x - kWsMmaThreads, lane = pt & 31, pw = pt >> 5, g = lane >> 2, t = lane & 3;
  const i32 nch = Kp / 128;
  for (i32 c = 0; c < nch; ++c) {
    const u32 slot = ring.slot(), full = ring.full_at(slot);
    mbar_wait(ring.empty_at(slot), ring.parity() ^ 1u);
    const u32 base = s0 + slot * St::kBytes;
    if (pw == 0) {  // the route tile: two bulk copies (the stage's transfer count)
      if (lane == 0) mbar_arrive_expect_tx(full, BR * 256);
      __syncwarp();
      if (lane < 2) bulk_copy(base + lane * (BR * 128), img + ((i64)(2 * c + lane) * Rp + m0) * 64, BR * 128, full);
    }
    if constexpr (kRuns) {  // tiled codes and records: each run copied by one warp, 16 bytes a lane
      i32 jc = 0, nb = 0;  // the chunk's first scale block and its blocks
      if constexpr (kScaled) {
        jc = QA::block_of((i64)c * 128);
        nb = min(St::kChunkBlocks, qa.blocks_per_row() - jc);
      }
#pragma unroll 1
      for (int q = pw; q < 2 * kWsTiles; q += 4) {  // run q: tile q / 2, lane row q % 2
        const int tl = q >> 1, r = q & 1;
        const WsRow rw = row_of(nt * kWsTiles + tl, 0);
        const i32 m = ((r ? rw.mb : rw.ma) >> 3) << 3;  // the lane row group: tile rows m .. m + 7
        const u32 tb = base + St::kXBytes + tl * St::kTileBytes;
        const u8* src = (r ? wb + CodeRows<B>::row(e, qb.N, m, qb.K) : wa + CodeRows<B>::row(e, qa.N, m, qa.K)) +
                        CodeRows<B>::seg(4 * c);
        for (int o = lane * 16; o < 128 * B; o += 512) cp_async(tb + r * 32 * CB + o, src + o, 16, true);
        if constexpr (kScaled) {
          const u8* rec = r ? reinterpret_cast<const u8*>(qb.scales) + qb.meta_group(e, m, jc)
                            : reinterpret_cast<const u8*>(qa.scales) + qa.meta_group(e, m, jc);
          const i32 bytes = nb * (r ? QB::kMetaBlockStride : QA::kMetaBlockStride);
          for (int o = lane * 16; o < bytes; o += 512) cp_async(tb + St::kTileCodes + r * St::kWords * 128 + o, rec + o, 16, true);
        }
      }
    }
    if constexpr (!kRuns) {  // lane by lane: thread (pw, lane) copies lane `lane` of MMA warps pw·C ..
      const i32 k0 = c * 128 + 32 * t;
      const bool live = k0 < K;
      const i64 off = live ? CodeRows<B>::seg(k0 / 32) : 0;
      const i32 j = live ? QA::block_of(k0) : 0;
#pragma unroll 1
      for (int q = 0; q < kWsConsumers * kWsMW; ++q) {
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
    cp_async_arrive(full);
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
  using D = MmaDeq<T, B, QA::kZp>;
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
      if constexpr (kScaled && WsRuns<QA, QB>::value) {  // records copied as runs (ws_produce)
        lds_codes<B>(wst + lane * CB, ra[m]);
        lds_codes<B>(wst + (32 + lane) * CB, rb[m]);
#pragma unroll
        for (int h = 0; h < NSB; ++h) {
          const u8* ma = wst + St::kTileCodes;
          const i32 jj = j0 + h - QA::block_of((i64)c * 128);
          ca[m][h] = live ? D::coef(ws_meta(qa, ma, lr.na[m], lane >> 2, jj)) : D::zero();
          cb[m][h] = live ? D::coef(ws_meta(qb, ma + St::kWords * 128, lr.nb[m], lane >> 2, jj)) : D::zero();
        }
      } else {
        lane_tile_load<T, B, St::kWords, ZPW>(
            wst + lane * CB, wst + (32 + lane) * CB,
            reinterpret_cast<const u32*>(wst + St::kTileCodes + LaneMeta<QA, ZPW>::lane_bytes(lane)), qa, sba[m],
            lr.na[m], lr.rca[m], qb, sbb[m], lr.nb[m], lr.rcb[m], e, j0, live, ra[m], rb[m], ca[m], cb[m]);
      }
    }
    u32 a[kWsInflight + 1][kWsMW][4];
    const u64 desc = smem_desc(xs);
#pragma unroll
    for (int s = 0; s < 8; ++s) {
#pragma unroll
      for (int m = 0; m < kWsMW; ++m)
        D::template fragment<kScaled, NSB>(a[s % (kWsInflight + 1)][m], ra[m], rb[m], ca[m], cb[m], s);
#pragma unroll
      for (int m = 0; m < kWsMW; ++m) wgmma_hold(acc[m]);
      wgmma_fence();
#pragma unroll
      for (int m = 0; m < kWsMW; ++m)
        Wgmma<T, BR>::mma(acc[m], a[s % (kWsInflight + 1)][m], desc + smem_desc_step<BR>(s));
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

// Barriers and the ring's start: full[s] counts the copy warpgroup's 128 threads (cp_async_arrive) and
// warp 0's announcement of the stage's bulk bytes (an arrival too); empty[s] counts the MMA warps.
template <int S> __device__ __forceinline__ WsRing<S> ws_ring(u64* bars) {
  WsRing<S> ring;
  ring.full = (u32)__cvta_generic_to_shared(bars);
  ring.empty = ring.full + 8 * S;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      mbar_init(ring.full_at(s), 128 + 1);
      mbar_init(ring.empty_at(s), kWsWarps);
    }
  }
  __syncthreads();
  return ring;
}

}  // namespace qmoe
