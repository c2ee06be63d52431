// engines/wg_mainloop.cuh: the main loop of the wgmma prefill engine's GEMMs (engines/wgmma_prefill.cuh):
// the pipeline stage and its ring (WgStage: its layout here, its counts the host's, kernels/wgmma_geometry.py),
// one route tile's chunks of K through it (wg_mainloop), and the MMA width an expert's last tile shrinks to (wg_tile).
//
// Block: WgStage::kGroups warpgroups × 64 weight rows (warp w: rows 16w .. 16w + 15 of the tile, the
// mma_prefill lane layout with one m16 tile) × BR routes; acc[BR / 2] f32 per thread (core/wgmma.cuh).
// K in chunks of 128 through a cp.async ring of WgStage::kStages stages (the host's count: as many as fit, at
// most QMOE_WG_STAGES); per k16 step a warp builds its A fragment while the previous QMOE_WG_INFLIGHT MMAs
// run. With three stages or more the copies run S - 2 chunks ahead and a chunk's last MMA overlaps the
// next chunk (the slot refilled is two chunks old); with two, each chunk drains its MMAs before the
// slot is reused.
//
// The ring's hand-off (QMOE_WG_RING; 0: kWgStageBarriers decides): 1, a block barrier a chunk (every warp
// waits for the slowest at every chunk); 2, barriers with phases a stage (core/mbarrier.cuh): a stage's
// `full` barrier completes when every thread's copies into it landed (cp.async arrives), its `empty` one
// when every warp's MMAs of its chunk are done, so a warp waits only for the copies it reads and, before
// refilling a stage, for the warps still reading it: warps drift up to S - 1 - A chunks apart instead of
// none. Copies (generic proxy) reach the MMAs (async proxy) by the reader's proxy fence after its wait.
// One main loop a block (the barriers are set up at its start).
//
// Clusters (CL = 2, the kernels' `_pair` forms; stage barriers): the two blocks of a cluster compute consecutive weight tiles
// of one route tile (grid_tile), which comes from a route-tile image (core/wg_order.cuh) instead of route rows:
// each block copies one half chunk of it into both blocks' stages at once (a multicast bulk copy counted on
// each block's `full` barrier), so the route tile crosses from L2 once for two blocks (a tenth of the time at
// mixtral-8x7b 4096 went to those bytes, docs/performance.md). A stage is refilled once both blocks' warps are
// done with it: each warp arrives on its own block's `empty` barrier and on the other's.
#pragma once

#include "core/cluster.cuh"
#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/lane_meta.cuh"
#include "core/mbarrier.cuh"
#include "core/mma_pair.cuh"
#include "core/stamps.cuh"
#include "core/types.cuh"
#include "core/wgmma.cuh"
#include "engines/lane_tiles.cuh"
#include "engines/tile_rows.cuh"

namespace qmoe {

#if !defined(QMOE_WG_STAGES) || !defined(QMOE_WG_STAGE_BUDGET) || !defined(QMOE_WG_RINGS) || !defined(QMOE_WG_FC1_BOUNDS)
#error "QMOE_WG_STAGES, QMOE_WG_STAGE_BUDGET, QMOE_WG_RINGS and QMOE_WG_FC1_BOUNDS come from the host (kernels/wgmma_prefill.py)"
#endif
inline constexpr int kWgMaxStages = QMOE_WG_STAGES;  // the deepest ring the host may choose (knob prefill_wg_stages)
#ifndef QMOE_WG_INFLIGHT
#define QMOE_WG_INFLIGHT 1
#endif
inline constexpr int kWgInflight = QMOE_WG_INFLIGHT;  // MMAs a warpgroup keeps in flight (1 or 2), A buffers: one more
static_assert(kWgInflight == 1 || kWgInflight == 2, "QMOE_WG_INFLIGHT must be 1 or 2");
#ifndef QMOE_WG_RING
#define QMOE_WG_RING 0
#endif
static_assert(QMOE_WG_RING >= 0 && QMOE_WG_RING <= 2, "QMOE_WG_RING: 0 (by the block), 1 (a block barrier a chunk), 2 (a stage's barriers)");
// The stage barriers where a block of 4 warpgroups has its SM alone (H200, one process, the peers'
// layer: mixtral-8x7b 4096 tokens -5.6 %, ort-2048 512 -3.2 %, qwen3-30b-a3b 4096 -1.5 %); with two blocks an
// SM, whose second block fills the first's waits, they cost 4-15 % (gpt-oss-120b 512, mixtral 64, qwen3 512). Blocks
// in clusters of CL > 1 always hand it on so.
template <class St, int CL = 1>
inline constexpr bool kWgStageBarriers = CL > 1 || QMOE_WG_RING == 2 || (QMOE_WG_RING == 0 && St::kGroups == 4);
// The shared memory a block's stages may take, from the host (kernels/wgmma_geometry.py SMEM_BUDGET: the target's
// opt-in limit per block less 1 KiB alignment slack and 4 KiB static): every ring is checked against it.
inline constexpr int kWgSmemBudget = QMOE_WG_STAGE_BUDGET;

// Each GEMM's ring as the host decided it (kernels/wgmma_geometry.py ring), one row per stage the unit's GEMMs
// hold (their codes' bits, packed zero-point words, scale bytes, scale block, route tile), from the generated
// unit's QMOE_WG_RINGS: stages, warpgroups per block, blocks an SM (the launch bounds' and the grid's) and the
// bytes of a stage, which the layout below must reproduce. The device reads these counts and only checks them.
struct WgRing {
  int bits, zpw, scale_bytes, block, br;  // the key (zpw: 0 / 1)
  int stages, groups, blocks;             // the host's decision
  int bytes;                              // a stage's bytes as the host sized it
};
inline constexpr WgRing wg_ring(int bits, bool zpw, int scale_bytes, int block, int br) {
  constexpr WgRing rows[] = {QMOE_WG_RINGS};
  for (const WgRing& r : rows)
    if (r.bits == bits && r.zpw == (zpw ? 1 : 0) && r.scale_bytes == scale_bytes && r.block == block && r.br == br) return r;
  return WgRing{bits, zpw ? 1 : 0, scale_bytes, block, br, 0, 0, 0, 0};  // not listed: the checks of WgStage fail
}

// One pipeline stage (1024-aligned, in dynamic shared memory):
//   x     [2 halves][BR][128 B]                 logical k 0..63 / 64..127 of the tile's routes,
//                                               128-byte swizzle (unit u of row r at u ^ (r & 7))
//   codes [warps][2 rows][32 lanes][4·B B]      each lane's 32 codes of its two rows
//   meta  [warps][2 rows][kWords][32] u32       their scale / zp words (block-wise scales only)
// A block has kGroups warpgroups × 64 weight rows and kStages stages, kMinBlocks of them an SM (kShare: two), as
// the host's row for the stage says (wg_ring; why 2 or 4 warpgroups: kernels/wgmma_geometry.py tile_groups).
template <int B, typename ScaleT, int BLOCK, bool ZPW, int BR> struct WgStage {
  using W = LaneTileBytes<B, ScaleT, BLOCK, ZPW, 1>;  // a warp's tile (engines/lane_tiles.cuh)
  static constexpr int kXBytes = BR * 256;
  static constexpr int kWords = W::kWords;
  static constexpr int kCB = W::kCB;
  static constexpr int kWarpCodes = W::kCodes;
  static constexpr int kWarpBytes = W::kBytes;
  static constexpr int kBytes2 = (kXBytes + 8 * kWarpBytes + 1023) / 1024 * 1024;  // a stage of 2 warpgroups
  static constexpr bool kShare = wg_ring(B, ZPW, (int)sizeof(ScaleT), BLOCK, BR).blocks == 2;  // two blocks share an SM
  static constexpr int kGroups = wg_ring(B, ZPW, (int)sizeof(ScaleT), BLOCK, BR).groups;
  static constexpr int kThreads = 128 * kGroups, kWarps = 4 * kGroups;  // a warp: one m16 weight tile
  // registers for this many blocks an SM (at 32 routes the rings of four stages fit three times: the host's
  // launch decides whether FC1 takes a third, kernels/wgmma_geometry.py launch_smem)
  static constexpr int kMinBlocks = wg_ring(B, ZPW, (int)sizeof(ScaleT), BLOCK, BR).blocks;
  static constexpr int kBytes = (kXBytes + kWarps * kWarpBytes + 1023) / 1024 * 1024;
  static constexpr int kStages = wg_ring(B, ZPW, (int)sizeof(ScaleT), BLOCK, BR).stages;
  static_assert(kGroups == 2 || kGroups == 4, "the host's ring (QMOE_WG_RINGS) lists no stage of these bits, zero "
                                              "points and route tile, or gives it other than 2 or 4 warpgroups");
  static_assert(kBytes == wg_ring(B, ZPW, (int)sizeof(ScaleT), BLOCK, BR).bytes && (kGroups != 2 || kBytes == kBytes2),
                "the host's stage bytes (kernels/wgmma_geometry.py stage_bytes) and this layout disagree");
  static_assert(kStages >= 2 && kStages <= kWgMaxStages, "the host's ring: 2 to QMOE_WG_STAGES stages");
  static_assert(kStages * kBytes <= kWgSmemBudget, "the host's ring passes the block's shared memory budget");
  static_assert(kMinBlocks == 1 || kMinBlocks == 2, "the host's ring: one or two blocks an SM");
};

// acc (lane (g, t) of warp w: rows 16w + g / + 8, routes 8j + 2t (+1)) = W[lane rows] · act[tile routes]ᵀ
// over chunks [c0, c1) of K (128 values each), for the tile's first NR routes (NR <= BR: the MMAs' N; a tile that holds no
// more routes than NR copies and multiplies only those, acc[NR / 2 ..] stay untouched). Route row i of
// the tile starts at src + s_row[i] (an element offset); padding rows (past the tile's routes) repeat its last route, whose extra
// columns are never stored. In clusters of CL = 2 blocks: src is the tile's first row in a route-tile image, whose half
// chunk q starts q·half elements on (s_row unused); its rows past the tile's routes are other tiles', never stored.
template <typename T, int B, int BR, int NR, bool ZPW, class QA, class QB, class St, int CL>
__device__ __forceinline__ void wg_mainloop(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, 1>& lr, i32 e,
                                            const T* src, const u32* s_row, i64 half, i32 K, i32 c0, i32 c1,
                                            float (&acc_br)[BR / 2], u8* smem, Stamps& st) {
  static_assert(CL == 1 || CL == 2, "blocks a cluster: 1 or 2");
  constexpr int kThreads = St::kThreads;
  static_assert(NR <= BR && NR * 16 % kThreads == 0, "MMA routes: a route tile's 16-byte units spread evenly");
  float(&acc)[NR / 2] = reinterpret_cast<float(&)[NR / 2]>(acc_br);
  constexpr int CB = St::kCB, S = St::kStages;
  constexpr bool kScaled = QA::kBlock != 0;
  constexpr int NSB = MetaLayout<typename QA::Scale, QA::kBlock, ZPW>::NSB;
  using D = MmaDeq<T, B, QA::kZp>;
  // Every lane's codes lie inside K when both rows' scale blocks make K a whole number of chunks: no lane
  // needs the zero-filled copies and coefficients of the codes past K (the `live` selects, compiled out)
  constexpr bool kWhole = QA::kWholeChunks && QB::kWholeChunks;
  // 16-bit scales of the activations' type: a coefficient's scale splat is a byte permute of the staged word
  constexpr bool kSplat = kScaled && !D::kF32 && kSame<typename QA::Scale, T> && kSame<typename QB::Scale, T>;
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
  if constexpr (CL == 1) {
#pragma unroll
    for (int q = 0; q < NQ; ++q) xrow[q] = s_row[r0 + q * kRowStep] + u * 8;
  }

  // with whole chunks, the lane's segment t of its two rows (chunk c's segment 4c + t lies c · CodeRows::kChunkBytes on)
  const u8* const pa = kWhole ? lr.pa[0] + CodeRows<B>::seg(t) : lr.pa[0];
  const u8* const pb = kWhole ? lr.pb[0] + CodeRows<B>::seg(t) : lr.pb[0];

  auto issue = [&](i32 slot, i32 c) {
    const u32 base = s0 + slot * St::kBytes;
    if constexpr (CL == 1) {  // in clusters the route tile comes by the stage loop's multicast (x_multicast)
#pragma unroll
      for (int q = 0; q < NQ; ++q) cp_async(base + xoff + q * kRowStep * 128, src + (xrow[q] + c * 128), 16, true);
    }
    const u32 wbase = base + St::kXBytes + warp * St::kWarpBytes;
    const i32 k0 = c * 128 + 32 * t;
    const bool live = kWhole || k0 < K;
    // segment 4c + t (for other K the form of whole chunks took gpt-oss-120b's FC1 at 32 routes from 80 registers
    // to 82, past its third block); not live: copies nothing
    const i64 off = kWhole ? (i64)c * CodeRows<B>::kChunkBytes : live ? CodeRows<B>::seg(k0 / 32) : 0;
    const i32 j = live ? QA::block_of_u(k0) : 0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u8* p = (r ? pb : pa) + off;
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
    const bool live = kWhole || k0 < K;  // lanes past K hold zero-filled codes; their pairs are exact zeros
    const i32 j0 = live ? QA::block_of_u(k0) : 0;
    u32 ra[B], rb[B];
    lds_codes<B>(wst + lane * CB, ra);
    lds_codes<B>(wst + (32 + lane) * CB, rb);
    Coef ca[NSB], cb[NSB];
#pragma unroll
    for (int h = 0; h < NSB; ++h) {
      if constexpr (kScaled) {
        const u32* ma = reinterpret_cast<const u32*>(wst + St::kWarpCodes + LaneMeta<QA, ZPW>::lane_bytes(lane));
        const u32* mb = ma + St::kWords * 32;
        Coef xa = D::coef(LaneMeta<QA, ZPW>::decode(qa, ma, sba, e, lr.na[0], j0, h));
        Coef xb = D::coef(LaneMeta<QB, ZPW>::decode(qb, mb, sbb, e, lr.nb[0], j0, h));
        if constexpr (kSplat) {  // splat(to_float(scale))'s value in one byte permute; the float round trip goes unused
          xa.sc = LaneMeta<QA, ZPW>::scale_splat(qa, ma, sba, lr.na[0], j0, h);
          xb.sc = LaneMeta<QB, ZPW>::scale_splat(qb, mb, sbb, lr.nb[0], j0, h);
        }
        ca[h] = live ? xa : D::zero();
        cb[h] = live ? xb : D::zero();
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
    if constexpr (S == 2 && !kWgStageBarriers<St, CL>) {
      wgmma_wait<0>();  // this stage's shared memory is refilled after the next barrier
      wgmma_hold(acc);
    }
  };

  constexpr int A = S >= 3 ? S - 2 : 1;  // chunks the copies run ahead
  if constexpr (kWgStageBarriers<St, CL>) {
    // full[s] at bars + 8s (every thread's copies landed), empty[s] at bars + 8(S + s) (every warp's MMAs done)
    // In clusters full[s] also counts thread 0's arrival with the route tile's bytes, empty[s] both blocks' warps.
    __shared__ alignas(8) u64 s_bars[2 * S];
    const u32 bars = (u32)__cvta_generic_to_shared(s_bars);
    if (threadIdx.x == 0) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        mbar_init(bars + 8 * s, kThreads + (CL > 1 ? 1 : 0));
        mbar_init(bars + 8 * (S + s), CL * St::kWarps);
      }
      if constexpr (CL > 1) fence_mbar_init();
    }
    if constexpr (CL > 1) cluster_sync();  // both blocks' barriers set up before either copies or arrives
    else __syncthreads();
    const u32 rank = CL > 1 ? cluster_rank() : 0, peer_bars = CL > 1 ? cluster_map(bars, rank ^ 1) : 0;
    // this block's half chunk of the route tile into both blocks' stage `slot` (thread 0; no branch between MMAs)
    auto x_multicast = [&](u32 slot, i32 c) {
      if constexpr (CL > 1) {
        const u32 full = bars + 8 * slot;
        mbar_arrive_expect_tx_if(full, NR * 256, threadIdx.x == 0);
        bulk_copy_multicast_if(s0 + slot * St::kBytes + rank * (BR * 128), src + (2 * c + (i32)rank) * half, NR * 128, full,
                               0x3, threadIdx.x == 0);
      }
    };
#pragma unroll
    for (int i = 0; i < A; ++i) {
      if (i < nch) {
        issue(i, c0 + i);
        x_multicast(i, c0 + i);
        cp_async_arrive(bars + 8 * i);
      }
    }
    st.loop_start();
    // As counters (from c, c % S and c / S took ~7 more instructions a chunk): chunk c's stage c % S and the parity
    // of its pass, (c / S) & 1; the stage chunk c + A refills, (c + A) % S, and the parity of the pass whose readers
    // it waits for, ((c + A) / S - 1) & 1; the stage of chunk c - 1.
    u32 slot = 0, par = 0, nslot = A % S, npar = 1, pslot = S - 1;
    for (i32 c = 0; c < nch; ++c) {  // the c-th chunk of the range: chunk c0 + c of K
      st.wait_start();
      mbar_wait(bars + 8 * slot, par);  // every thread's copies of chunk c landed
      fence_async_shared();             // ... and are visible to this warp's MMAs
      st.wait_end();
      compute(slot, c0 + c);
      // compute(c) waited for every MMA of chunk c - 1 (it keeps at most kWgInflight of chunk c in flight):
      // this warp is done with its stage
      __syncwarp();
      mbar_arrive_if(bars + 8 * (S + pslot), lane == 0 && c >= 1);
      if constexpr (CL > 1) mbar_arrive_cluster_if(peer_bars + 8 * (S + pslot), lane == 1 && c >= 1);
      if (c + A < nch) {  // into the stage of chunk c + A - S <= c - 1, once every warp (of both blocks) released it
        if (c + A >= S) mbar_wait(bars + 8 * (S + nslot), npar);
        issue(nslot, c0 + c + A);
        x_multicast(nslot, c0 + c + A);
        cp_async_arrive(bars + 8 * nslot);
      }
      pslot = slot;
      slot = slot + 1 == S ? 0 : slot + 1;
      par ^= slot == 0 ? 1u : 0u;
      nslot = nslot + 1 == S ? 0 : nslot + 1;
      npar ^= nslot == 0 ? 1u : 0u;
    }
  } else {
#pragma unroll
    for (int i = 0; i < A; ++i) {
      if (i < nch) issue(i, c0 + i);
      cp_async_commit();
    }
    st.loop_start();
    for (i32 c = 0; c < nch; ++c) {  // the c-th chunk of the range: chunk c0 + c of K
      st.wait_start();
      cp_async_wait<A - 1>();
      fence_async_shared();  // cp.async data, read by the async proxy
      __syncthreads();       // every thread's copies of chunk c landed; every MMA of chunk c - 2 is done
      st.wait_end();
      const i32 cn = c + A;
      if (cn < nch) issue(cn % S, c0 + cn);
      cp_async_commit();
      compute(c % S, c0 + c);
    }
  }
  wgmma_wait<0>();
  wgmma_hold(acc);
  cp_async_wait<0>();
  // in clusters: this block's last arrival on the other's barriers and its last copy into it are behind it (every
  // copy it received landed); the kernel waits (cluster_wait) before it exits
  if constexpr (CL > 1) cluster_arrive();
  st.loop_end();
}

// The main loop with the fewest MMA routes that hold the tile's `routes`: BR, BR / 2 or BR / 4 (BR / 4 from
// QMOE_WG_SHRINK 2; at least 32 routes, 16 with 3 where a block has 256 threads). An expert's last route tile
// is rarely full (at a few hundred tokens nearly empty). Each width is a copy of the main loop (compile time);
// without BR / 4 the layer measured up to 4 % slower (docs/performance-log.md); 16 routes took
// 3.5-4.5 % off gpt-oss-120b at 512 tokens, ~16 routes an expert.
#ifndef QMOE_WG_SHRINK
#define QMOE_WG_SHRINK 3
#endif
template <typename T, int B, int BR, bool ZPW, class QA, class QB, class St, int CL>
__device__ __forceinline__ void wg_tile(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, 1>& lr, i32 e,
                                        const T* src, const u32* s_row, i64 half, i32 routes, i32 K, i32 c0, i32 c1,
                                        float (&acc)[BR / 2], u8* smem, Stamps& st) {
  static_assert(QMOE_WG_SHRINK >= 1 && QMOE_WG_SHRINK <= 3, "QMOE_WG_SHRINK: 1 (BR / 2), 2 (and BR / 4), 3 (to 16)");
  constexpr int kLeast = QMOE_WG_SHRINK == 3 && 16 * 16 % St::kThreads == 0 ? 16 : 32;  // the fewest MMA routes
  constexpr int kHalf = BR / 2 >= kLeast ? BR / 2 : BR;
  constexpr int kQuarter = QMOE_WG_SHRINK >= 2 && BR / 4 >= kLeast ? BR / 4 : kHalf;
  if (kQuarter < kHalf && routes <= kQuarter)
    wg_mainloop<T, B, BR, kQuarter, ZPW, QA, QB, St, CL>(qa, qb, lr, e, src, s_row, half, K, c0, c1, acc, smem, st);
  else if (kHalf < BR && routes <= kHalf)
    wg_mainloop<T, B, BR, kHalf, ZPW, QA, QB, St, CL>(qa, qb, lr, e, src, s_row, half, K, c0, c1, acc, smem, st);
  else
    wg_mainloop<T, B, BR, BR, ZPW, QA, QB, St, CL>(qa, qb, lr, e, src, s_row, half, K, c0, c1, acc, smem, st);
}

}  // namespace qmoe
