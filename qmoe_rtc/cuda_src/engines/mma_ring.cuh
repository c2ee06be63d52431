// engines/mma_ring.cuh: the per-warp weight stream of the tensor-core decode kernels -- a cp.async
// ring of each warp's two lane rows (codes + scale / zero-point words, each lane reading back only
// what it copied, so no barrier), and the warp's mma.sync product over its slice of K (mma_rows).
//
// Warp tile = one mma.sync m16n8k16 (f32 accumulate): A = 16 weight rows × 16 codes dequantized
// exactly in registers (core/mma_pair.cuh), B = 16 activations × 8 routes, C = 16 rows × 8 routes.
// K is walked in chunks of 128 codes; lane (g, t) = (lane / 4, lane % 4) loads 32 consecutive codes
// of rows g and g + 8 and the matching 32 activations of route g.
// Scales: block size ≥ 128 or row-wise — one scale per row over a 128-code chunk — the mma sums the
// exact (q − zp)·x in float32 and the row scale multiplies that partial sum; smaller blocks — each
// pair is multiplied by its scale in T first (rounded once, like any dequantize-to-T engine).
#pragma once

#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/lane_meta.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "engines/slice_reduce.cuh"
#include "engines/x_block.cuh"
#include "engines/x_ring.cuh"
#include "engines/mma_stage.cuh"  // after x_ring.cuh: the order of the constants in the cubin
#include "engines/ring_gate.cuh"
#include "engines/ring_smem.cuh"

namespace qmoe {

// Warms L2 with the first `chunks` chunks of the lane's two rows (no registers held): issued before
// the route scan so the weights are on their way while the block finds its routes.
template <int B> __device__ __forceinline__ void prefetch_rows(const u8* pa, const u8* pb, i32 K, i32 ks, i32 KS,
                                                               i32 chunks) {
  const i32 t = threadIdx.x & 3, nch = (K + kMmaChunk - 1) / kMmaChunk;
  for (i32 i = 0, c = ks; i < chunks && c < nch; ++i, c += KS) {
    const i32 k0 = c * kMmaChunk + 32 * t;
    if (k0 >= K) break;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(pa + CodeRows<B>::seg(k0 / 32)));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(pb + CodeRows<B>::seg(k0 / 32)));
  }
}

// One warp's product over its K slice (chunks ks, ks + KS, ...) for RT 16-row tiles: acc[i·N8 + g]
// (C fragments) += W[rows na[i], nb[i]] · x[routes]ᵀ. pa[i], pb[i]: tile i's lane rows' packed codes
// (K·B/8 bytes each); qa, qb their quant params; xrow[g]: the activation row of n8 route group g's lane
// route, or null. RT 2 (tiled codes only): each route group's activations, loaded once per chunk, feed
// both tiles' MMAs (half the activation loads per weight, two independent MMA chains).
// Weights, scales and zero points stream through a kMmaStages-deep cp.async ring per warp; each lane
// reads back only what it copied, so no barrier is needed (except with COOP).
// COOP (3-bit only): the warp copies each row's 48-byte chunk of codes as three 16-byte pieces (lane
// L < 24: lane group L / 3's rows, piece L % 3) into the same shared layout, instead of each lane
// copying its own 12 bytes as three 4-byte pieces; lanes then read codes other lanes copied (a
// __syncwarp per stage). Needs every row's chunks 16-byte aligned (mma_rows checks).
// xrow may change until the gate returns (its activations are read after it).
// XB (an XBlock, engines/x_block.cuh): the activations come from the block's shared stages, which every thread of
// the block fills (xrow unused); the block's warps then run the same number of stages, with a barrier each.
template <typename T, int B, int N8, int RT, bool COOP, bool COHERENT_X, bool PAIRED, bool XST, class QA, class QB,
          typename XT, class G = NoGate, class XB = NoXBlock>
__device__ __forceinline__ bool mma_rows_ring(const QA& qa, const u8* const (&pa)[RT], const i32 (&na)[RT],
                                              const QB& qb, const u8* const (&pb)[RT], const i32 (&nb)[RT], i32 e,
                                              const XT* const (&xrow)[N8], i32 K, i32 ks, i32 KS,
                                              float (&acc)[RT * N8][4], u8* ring, u8* xring, i32 xs, G gate = G{},
                                              const XB xb = XB{}) {
  static_assert(!COOP || B == 3, "shared code copies are for 3-bit codes");
  static_assert(!XB::kOn || (!XST && !GateActive<G>::value && sizeof(XT) == 2),
                "block-staged activations: 2-byte, without x rings or a gate");
  // XST: the activations of route lanes g < xs staged in the warp's x ring (engines/x_ring.cuh; one route group,
  // one row tile); lanes past xs hold no route (an expert has at most xs routes: the caller checks)
  constexpr bool kXst = XST && N8 == 1 && RT == 1;
  static_assert(!kXst || sizeof(XT) == 2, "x rings hold 2-byte activations (XRing::kChunkBytes)");
  static_assert(RT == 1 || kTiled, "several row tiles per warp read the tiled layout's activation words");
  using ScaleT = typename QA::Scale;
  constexpr bool kZpw = QA::kZp == ZP_PACKED || QB::kZp == ZP_PACKED;  // = the kernel's Stage
  using St = MmaStage<B, ScaleT, QA::kBlock, kZpw, RT>;
  using D = MmaDeq<T, B, QA::kZp>;
  constexpr int KST = St::KST, NSB = St::NSB, CB = St::kCodeBytes, NR = St::kRows;
  const i32 lane = threadIdx.x & 31, t = lane & 3;
  const i32 nch = (K + kMmaChunk - 1) / kMmaChunk;
  const i32 step = KS * KST;  // chunks a warp advances per stage
  const u32 ring0 = (u32)__cvta_generic_to_shared(ring);
  using XR = XRing<kMmaStages * KST>;
  const XR xr = XR::of(kXst ? xring : ring, kXst ? xs : 1, lane);

  // kFactor: one scale per row over a whole chunk (block >= 128 or row-wise): the mma sums the exact
  // (q - zp)·x of a chunk in float32 and the row scale multiplies that partial sum (fewer
  // instructions, and the products are never rounded to T). Else each pair is scaled in T.
  constexpr bool kFactor = QA::kBlock == 0 || QA::kBlock >= kMmaChunk;
  i64 sbase[RT][2];  // where block 0 of each lane row's scale lives (LaneMeta::base)
  // PAIRED (the caller's rows na[i], nb[i] are rows g and g + 8 of one projection's 16-row tile, clamped
  // past N: FC2, ungated and interleaved FC1) with tiled meta: one record holds both rows' coefficients,
  // copied once and decoded twice (a clamped row's record differs, but its outputs are never stored)
  constexpr bool kPaired = PAIRED && QA::kTiledMeta;
  const u8* src[RT][2];  // the rows this lane copies codes from (COOP: its lane group's)
  const i32 cgr = lane / 3, cpc = lane % 3;
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    sbase[i][0] = LaneMeta<QA, kZpw>::base(qa, e, na[i]);
    sbase[i][1] = LaneMeta<QB, kZpw>::base(qb, e, nb[i]);
    src[i][0] = pa[i];
    src[i][1] = pb[i];
    if constexpr (COOP) {
      const i32 from = 4 * min(cgr, 7);
#pragma unroll
      for (int r = 0; r < 2; ++r)
        src[i][r] = reinterpret_cast<const u8*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(src[i][r]), from));
    }
  }

  auto issue = [&](i32 slot, i32 c0, auto parts) {
    using P = decltype(parts);
    const u32 base = ring0 + slot * St::kBytes;
    // a rolled loop for narrow codes (KST 4 / 8 chunks a stage: unrolled, the chunks' hoisted
    // addresses made the kernels spill, int2 ~50 bytes, int1 ~450; rolled: none, ~80 registers), for
    // scale blocks below a chunk (more meta words per chunk; gpt-oss-120b int4 block 32 measured
    // 58.7 -> 55.0 us at 1 token on the H200, docs/performance-log.md); rolled for every width it
    // measured within noise at block 128 (int4 FC1 96 -> 72 registers); COOP: rolled, its FC2 spilled 8 bytes unrolled (NVRTC 13.5); packed zero points (kZpw): rolled,
    // block 128 spilled 24-140 bytes unrolled (mixtral int4 163.9 us vs 126 without zero points)
#pragma unroll(KST > 2 || !kFactor || COOP || kZpw ? 1 : KST)
    for (int u = 0; u < KST; ++u) {
      const i32 c = c0 + u * KS, k0 = c * kMmaChunk + 32 * t;
      if (c >= nch) break;  // warp-uniform
      const bool live = k0 < K;
      // a row's chunk is 4·CB contiguous bytes in both layouts (core/codes.cuh), segment 4c on
      const i64 off = COOP ? CodeRows<B>::seg(4 * c) + 16 * cpc : (live ? CodeRows<B>::seg(k0 / 32) : 0);
      // the block of the lane's codes; with kFactor the block of the chunk (the same for every lane,
      // and valid on lanes past K, whose C fragments still need their rows' scale)
      const i32 j = kFactor ? QA::block_of((i64)c * kMmaChunk) : (live ? QA::block_of(k0) : 0);
      const bool mlive = kFactor || live;
#pragma unroll
      for (int i = 0; i < (P::kW ? RT : 0); ++i) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = u * NR + 2 * i + r;
          const u8* from = src[i][r] + off;
          if constexpr (COOP) {
            if (lane < 24) cp_async(base + row * 32 * CB + 48 * cgr + 16 * cpc, from, 16, true);
          } else {
            cp_async_codes<CB>(base + (row * 32 + lane) * CB, from, live);
          }
          const u32 meta = base + St::kCodes + (row * St::kWords) * 128 + LaneMeta<QA, kZpw>::lane_bytes(lane);
          if (r) {
            if constexpr (!kPaired) LaneMeta<QB, kZpw>::issue(qb, sbase[i][1], e, nb[i], j, meta, mlive, src[0][0]);
          } else {
            LaneMeta<QA, kZpw>::issue(qa, sbase[i][0], e, na[i], j, meta, mlive, src[0][0]);
          }
        }
      }
      if constexpr (kXst && P::kX) {
        if ((lane >> 2) < xs) {  // the lane's 32 activations of its route (zeros past K or without a route)
          const bool ok = xrow[0] != nullptr && live;
          const u8* from = ok ? reinterpret_cast<const u8*>(xrow[0] + k0) : src[0][0];
          xr.issue<!COHERENT_X>(slot * KST + u, from, ok);
        }
      }
    }
  };

  // Coefficients of tile i's row r (0: na, 1: nb) for scale block h of chunk u, from the stage's meta words
  // (a paired row 1: row 0's record).
  auto coef = [&](const u8* st, int u, int i, int r, int h, i32 j0) -> Coef {
    const int slot_row = u * NR + 2 * i + (kPaired ? 0 : r);
    const u32* meta = reinterpret_cast<const u32*>(st + St::kCodes + LaneMeta<QA, kZpw>::lane_bytes(lane)) +
                      (slot_row * St::kWords) * 32;
    return D::coef(r ? LaneMeta<QB, kZpw>::decode(qb, meta, sbase[i][1], e, nb[i], j0, h)
                     : LaneMeta<QA, kZpw>::decode(qa, meta, sbase[i][0], e, na[i], j0, h));
  };

  auto compute = [&](i32 slot, i32 c0) {
    const u8* st = ring + slot * St::kBytes;
#pragma unroll
    for (int u = 0; u < KST; ++u) {
      const i32 c = c0 + u * KS, k0 = c * kMmaChunk + 32 * t;
      if (c >= nch) break;  // warp-uniform
      const bool live = k0 < K;  // lanes past K (K % 128 != 0) hold zero-filled codes
      u32 cw[RT][2][B];
      Coef cf[RT][2][NSB];
      const i32 j0 = kFactor ? QA::block_of((i64)c * kMmaChunk) : QA::block_of(k0);
#pragma unroll
      for (int i = 0; i < RT; ++i) {
        lds_codes<B>(st + ((u * NR + 2 * i) * 32 + lane) * CB, cw[i][0]);
        lds_codes<B>(st + ((u * NR + 2 * i + 1) * 32 + lane) * CB, cw[i][1]);
      }
#pragma unroll
      for (int i = 0; i < RT; ++i)
#pragma unroll
        for (int h = 0; h < NSB; ++h)
#pragma unroll
          for (int r = 0; r < 2; ++r) cf[i][r][h] = (kFactor || live) ? coef(st, u, i, r, h, j0) : D::zero();
      // A fragment of k16 step s of tile i: pairs 2s, 2s + 1 of both lane rows
      auto frag = [&](int i, int s, u32 (&a)[4]) {
        D::template fragment<!kFactor, NSB>(a, cw[i][0], cw[i][1], cf[i][0], cf[i][1], s);
      };
      // the lane's activations of route group g: V 16-byte vectors (8 codes each) from code k0 + 8·v0
      auto load_x = [&](int g, int v0, auto& xw) {
        constexpr int V = sizeof(xw) / 16;
        if constexpr (XB::kOn) {  // zeros past K and without a route are in the stage
          xb.read(slot, ks + u * KS, g, v0, xw);
        } else if (xrow[g] != nullptr && live) {
          const uint4* px = reinterpret_cast<const uint4*>(xrow[g] + k0) + v0;
#pragma unroll
          for (int v = 0; v < V; ++v) {
            const uint4 q = COHERENT_X ? __ldcg(px + v) : __ldg(px + v);
            xw[4 * v] = q.x; xw[4 * v + 1] = q.y; xw[4 * v + 2] = q.z; xw[4 * v + 3] = q.w;
          }
        } else {
#pragma unroll
          for (int v = 0; v < 4 * V; ++v) xw[v] = 0u;
        }
      };
      // kFactor: the chunk's exact partial sums, scaled once per row
      auto finish = [&](int i, int g, const float (&part)[4]) {
        float (&c)[4] = acc[i * N8 + g];
        c[0] = fmaf(cf[i][0][0].scf, part[0], c[0]);  // C rows g (lane row na) ...
        c[1] = fmaf(cf[i][0][0].scf, part[1], c[1]);
        c[2] = fmaf(cf[i][1][0].scf, part[2], c[2]);  // ... and g + 8 (lane row nb)
        c[3] = fmaf(cf[i][1][0].scf, part[3], c[3]);
      };
      if constexpr (RT > 1) {
        // tiled codes: step s's activations are words 2s, 2s + 1 of the lane's 16 (x_pair); each half
        // chunk (4 steps) loads every route group's 8 words once and feeds them to every tile
        float part[RT][N8][4] = {};
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          u32 xh[N8][8];
#pragma unroll
          for (int g = 0; g < N8; ++g) load_x(g, 2 * hf, xh[g]);
#pragma unroll
          for (int s = 4 * hf; s < 4 * hf + 4; ++s) {
#pragma unroll
            for (int i = 0; i < RT; ++i) {
              u32 a[4];
              frag(i, s, a);
#pragma unroll
              for (int g = 0; g < N8; ++g)
                Pair2<T>::mma(kFactor ? part[i][g] : acc[i * N8 + g], a, xh[g][2 * (s - 4 * hf)],
                              xh[g][2 * (s - 4 * hf) + 1]);
            }
          }
        }
        if constexpr (kFactor) {
#pragma unroll
          for (int i = 0; i < RT; ++i)
#pragma unroll
            for (int g = 0; g < N8; ++g) finish(i, g, part[i][g]);
        }
      } else if constexpr (N8 == 1) {
        // one route group: each k16 step's fragment is dequantized just before its mma (ptxas gives
        // the same 94-96 registers as dequantizing all eight first)
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (kXst && kTiled) {  // staged, in pair order: each step's two words read just before its mma
          const bool xl = (lane >> 2) < xs;  // lanes past xs: no route, no copy; zeros (never another lane's copy)
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            u32 a[4];
            frag(0, s, a);
            const uint2 xv = xr.step(slot * KST + u, s, xl);
            Pair2<T>::mma(kFactor ? part : acc[0], a, xv.x, xv.y);
          }
        } else {
          u32 xw[16];
          if constexpr (kXst) {
            if ((lane >> 2) < xs) xr.read(slot * KST + u, xw);
            else
#pragma unroll
              for (int v = 0; v < 16; ++v) xw[v] = 0u;
          } else {
            load_x(0, 0, xw);
          }
#pragma unroll
          for (int s = 0; s < 8; ++s) {
            u32 a[4];
            frag(0, s, a);
            Pair2<T>::mma(kFactor ? part : acc[0], a, D::x_pair(xw, 2 * s), D::x_pair(xw, 2 * s + 1));
          }
        }
        if constexpr (kFactor) finish(0, 0, part);
      } else {
        // several route groups share each dequantized fragment
        u32 a[8][4];
#pragma unroll
        for (int s = 0; s < 8; ++s) frag(0, s, a[s]);
#pragma unroll
        for (int g = 0; g < N8; ++g) {
          u32 xw[16];
          load_x(g, 0, xw);
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int s = 0; s < 8; ++s) Pair2<T>::mma(kFactor ? part : acc[g], a[s], D::x_pair(xw, 2 * s), D::x_pair(xw, 2 * s + 1));
          if constexpr (kFactor) finish(0, g, part);
        }
      }
    }
  };

  // ring: stage i lives in slot i % S; S - 1 stages in flight while one is computed
  constexpr int S = kMmaStages;
  if constexpr (XB::kOn) {  // every warp runs every stage of the block (barriers); stage i: chunks [i·step, (i+1)·step)
    __syncthreads();        // the block's warps have read every slot of its previous product
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (ks + i * step < nch) issue(i, ks + i * step, RingParts<true, false>{});
      xb.template issue<COHERENT_X>(i, i * step, nch, K);
      cp_async_commit();
    }
    const i32 stages = (nch + step - 1) / step;
    for (i32 i = 0; i < stages; ++i) {
      cp_async_wait<S - 2>();  // stage i has landed (this thread's copies) ...
      __syncthreads();         // ... and every thread's; every warp has computed stage i - 1
      const i32 c = ks + i * step, cn = c + (S - 1) * step;
      if (cn < nch) issue((i + S - 1) % S, cn, RingParts<true, false>{});
      xb.template issue<COHERENT_X>((i + S - 1) % S, (i + S - 1) * step, nch, K);
      cp_async_commit();
      if (c < nch) compute(i % S, c);
    }
    cp_async_wait<0>();
    return true;
  }
  if constexpr (GateActive<G>::value) {  // weights, the gate, activations: stage i's copies are in groups <= i all the same
#pragma unroll
    for (int i = 0; i < S - 1; ++i)
      if (ks + i * step < nch) issue(i, ks + i * step, RingParts<true, false>{});
    if (!gate()) {
      cp_async_commit();
      cp_async_wait<0>();
      return false;
    }
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (ks + i * step < nch) issue(i, ks + i * step, RingParts<false, true>{});
      cp_async_commit();  // empty groups keep the count uniform
    }
  } else {
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      if (ks + i * step < nch) issue(i, ks + i * step, RingParts<true, true>{});
      cp_async_commit();  // empty groups keep the count uniform
    }
  }
  for (i32 i = 0, c = ks; c < nch; ++i, c += step) {
    cp_async_wait<S - 2>();  // stage i has landed (this lane's copies)
    if constexpr (COOP) __syncwarp();  // ... and the warp's; every lane has read slot i - 1
    const i32 cn = c + (S - 1) * step;
    if (cn < nch) issue((i + S - 1) % S, cn, RingParts<true, true>{});  // the slot computed in iteration i - 1
    cp_async_commit();
    compute(i % S, c);
  }
  cp_async_wait<0>();
  return true;
}

// One warp's product over its K slice for RT row tiles (mma_rows_ring); 3-bit codes whose row chunks
// are all 16-byte aligned (K % 128 == 0, 16-byte aligned rows: warp-uniform) take the shared 16-byte
// copies (measured on the H200, mixtral-8x7b int3 at 1 token: 151.2 -> 138.8 us;
// docs/performance-log.md). A gate's barriers need the choice block-uniform, and it is: with K % 128 == 0 a row
// is 48·K/128 bytes, so every row is aligned exactly when the codes' base is.
// COHERENT_X: the activations are read through L2 (ld.global.cg), not the read-only path: for inputs
// another grid may still be writing while this one runs (FC2 with the expert flow).
template <typename T, int B, int N8, int RT, bool COHERENT_X = false, bool PAIRED = false, bool XST = false, class QA,
          class QB, typename XT, class G = NoGate, class XB = NoXBlock>
__device__ __forceinline__ bool mma_tiles(const QA& qa, const u8* const (&pa)[RT], const i32 (&na)[RT], const QB& qb,
                                          const u8* const (&pb)[RT], const i32 (&nb)[RT], i32 e,
                                          const XT* const (&xrow)[N8], i32 K, i32 ks, i32 KS, float (&acc)[RT * N8][4],
                                          u8* ring, u8* xring = nullptr, i32 xs = 0, G gate = G{}, const XB xb = XB{}) {
  if constexpr (B == 3) {
    unsigned long long bits = 0;
#pragma unroll
    for (int i = 0; i < RT; ++i)
      bits |= reinterpret_cast<unsigned long long>(pa[i]) | reinterpret_cast<unsigned long long>(pb[i]);
    if (K % kMmaChunk == 0 && __all_sync(0xffffffffu, (bits & 15) == 0))
      return mma_rows_ring<T, B, N8, RT, true, COHERENT_X, PAIRED, XST>(qa, pa, na, qb, pb, nb, e, xrow, K, ks, KS, acc,
                                                                        ring, xring, xs, gate, xb);
  }
  return mma_rows_ring<T, B, N8, RT, false, COHERENT_X, PAIRED, XST>(qa, pa, na, qb, pb, nb, e, xrow, K, ks, KS, acc,
                                                                     ring, xring, xs, gate, xb);
}

// The decode engine's form: one 16-row tile (lane rows na, nb); XST (one route group): the activations of the
// first xs route lanes staged in the warp's x ring (xring) with the weights; gate: see NoGate.
template <typename T, int B, int N8, bool COHERENT_X = false, bool PAIRED = false, bool XST = false, class QA,
          class QB, typename XT, class G = NoGate>
__device__ __forceinline__ bool mma_rows(const QA& qa, const u8* __restrict__ pa, i32 na, const QB& qb,
                                         const u8* __restrict__ pb, i32 nb, i32 e, const XT* const (&xrow)[N8],
                                         i32 K, i32 ks, i32 KS, float (&acc)[N8][4], u8* ring, u8* xring, i32 xs,
                                         G gate = G{}) {
  const u8* const pas[1] = {pa};
  const u8* const pbs[1] = {pb};
  const i32 nas[1] = {na}, nbs[1] = {nb};
  return mma_tiles<T, B, N8, 1, COHERENT_X, PAIRED, XST>(qa, pas, nas, qb, pbs, nbs, e, xrow, K, ks, KS, acc, ring,
                                                         xring, xs, gate);
}

}  // namespace qmoe
