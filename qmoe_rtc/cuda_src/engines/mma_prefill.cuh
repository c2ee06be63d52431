// engines/mma_prefill.cuh: the tensor-core prefill engine (float16 / bfloat16 activations, 1/2/3/4/8-bit
// weights, mixed widths): grouped GEMMs over expert-contiguous routes (routing/group.cuh), FC1 with
// the activation fused (epilogue/fc1.cuh), FC2 + bias, then the weighted combine (epilogue/combine.cuh).
//
//   rg          RouteGroups         routing/group.cuh, route tiles of BR routes (N8 = BR / 8 n8 MMA tiles)
//   wt          Fc1Weights / Fc2Weights  the projections' tensors (core/args.cuh)
//   x           [rows, H]   T     FC1's activations: route rows gathered by index inside the tile copy
//                                 (row = route / k; no copy of the input per route)
//   act_sorted  [R, I]      T     FC1 out in sorted order (activation rounded to T), FC2's activations
//   y           [R, H]      f32   FC2 out by route id, bias added (the combine applies the routing weight)
//
// Block tile: BR routes × kPfRows weight rows (kPfWarps warps × kPfMW m16 tiles each). Grid: G
// consecutive route tiles × every weight tile, then the next G (the group's activations and the
// weight tiles in flight stay in L2). mma.sync m16n8k16, A = weights decoded exactly in registers
// (core/mma_pair.cuh: lane (g, t) holds 32 consecutive codes of rows g and g + 8 of a tile), B =
// activations of 8 routes, f32 accumulators; a warp's A fragments serve all N8 route groups.
// K goes in chunks of 128 codes through a kPfStages-deep cp.async pipeline: the block's activation
// tile [BR][128] in XOR-swizzled 16-byte units (a lane reads its 32 activations as 4 conflict-free
// 16-byte loads) and each warp's codes + scale / zero-point words (core/lane_meta.cuh).
// Scales: row-wise — the mma sums the exact (q − zp)·x and the epilogue applies the row scale;
// block-wise — each pair is scaled in T before the mma (rounded once, like a dequantize-to-T GEMM).
// Not covered (the executor runs the SIMT engine and says why): float32 activations,
// zero_point_offset, FC3 with a bit width other than FC1's, 1-bit with block 16, K % 32 ≠ 0.
#pragma once

#include "core/args.cuh"
#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/dequant.cuh"
#include "core/experts.cuh"
#include "core/lane_meta.cuh"
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "epilogue/fc2.cuh"
#include "engines/lane_tiles.cuh"
#include "engines/tile_rows.cuh"
#include "routing/group.cuh"
#include "routing/route_group.cuh"

namespace qmoe {

// The host's decisions (kernels/mma_prefill.py), which the device reads and only checks: warps a block, blocks an
// SM, pipeline stages (defines), and the bytes of each GEMM's stage by route tile (QMOE_PF_STAGE_BYTES {1 for FC1 or
// 2 for FC2, BR, bytes} in the generated unit), which PfStage's layout must give (pf_stage_is).
#if !defined(QMOE_PF_WARPS) || !defined(QMOE_PF_MIN_BLOCKS) || !defined(QMOE_PF_STAGES) || !defined(QMOE_PF_STAGE_BYTES)
#error "QMOE_PF_WARPS, QMOE_PF_MIN_BLOCKS, QMOE_PF_STAGES and QMOE_PF_STAGE_BYTES come from the host (kernels/mma_prefill.py)"
#endif
inline constexpr int kPfWarps = QMOE_PF_WARPS;          // 4 or 8: the block tile's weight rows = 32·kPfWarps
inline constexpr int kPfThreads = 32 * kPfWarps;
inline constexpr int kPfMinBlocks = QMOE_PF_MIN_BLOCKS;  // blocks per SM the register budget is set for
inline constexpr int kPfMW = 2;                         // m16 weight tiles per warp
inline constexpr int kPfTiles = kPfWarps * kPfMW;       // m16 tiles per block
inline constexpr int kPfChunk = 128;                    // codes of K per pipeline stage
inline constexpr int kPfStages = QMOE_PF_STAGES;

// One pipeline stage in dynamic shared memory:
//   x     [BR][16 units][16 B]                  the tile's activations for the chunk (unit u of route r
//                                               stored at u ^ pf_swizzle(u, r))
//   codes [warps][MW][2 rows][32 lanes][4·B B]  each lane's 32 codes of its rows
//   meta  [warps][MW][2 rows][kWords][32] u32   their scale / zp words (block-wise scales only:
//                                               row-wise ones are read once, before the loop)
template <int B, typename ScaleT, int BLOCK, bool ZPW, int BR> struct PfStage {
  using W = LaneTileBytes<B, ScaleT, BLOCK, ZPW, kPfMW>;  // a warp's tiles (engines/lane_tiles.cuh)
  static constexpr int kXBytes = BR * 256;
  static constexpr int kWords = W::kWords;
  static constexpr int kCB = W::kCB;
  static constexpr int kWarpCodes = W::kCodes;
  static constexpr int kWarpBytes = W::kBytes;
  static constexpr int kBytes = kXBytes + kPfWarps * kWarpBytes;
};

// A quarter warp reads rows r, r + 1 (r even) at units 4t + v, t = 0..3: with this swizzle its 8
// 16-byte loads fall in 8 distinct bank groups.
__device__ __forceinline__ int pf_swizzle(int u, int r) { return (((u >> 3) & 1) << 1) | (r & 1); }

// Whether the stage St of GEMM `role` (1: FC1, 2: FC2) at BR routes takes the host's bytes (kernels/mma_prefill.py
// stage_bytes, which sizes the launch).
template <class St> constexpr bool pf_stage_is(int role, int br) {
  constexpr int rows[][3] = {QMOE_PF_STAGE_BYTES};
  for (const auto& r : rows)
    if (r[0] == role && r[1] == br) return r[2] == St::kBytes;
  return false;
}

// The launch must give kPfStages stages (kernels/mma_prefill.py sizes it so, with the stage bytes the host lists
// for GEMM `ROLE`'s BR-route stage, checked here): trap, never overrun.
template <class St, int ROLE, int BR> __device__ __forceinline__ void pf_check_smem() {
  static_assert(pf_stage_is<St>(ROLE, BR), "the host's stage bytes (the generated unit) and this layout disagree");
  u32 have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < (u32)(kPfStages * St::kBytes)) __trap();
}

// The main loop FC1 and FC2 share: acc[m][j] (C fragments: rows g / g + 8 of warp tile m, routes
// 8j + 2t, 2t + 1) = W[lane rows] · act[tile routes]ᵀ over K. Route row i of the tile starts at
// src + s_src[i] (s_src[i] < 0: padding, read as zeros).
template <typename T, int B, int BR, bool ZPW, class QA, class QB, class St>
__device__ __forceinline__ void pf_mainloop(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, kPfMW>& lr, i32 e,
                                            const T* __restrict__ src, const i64* s_src, i32 K,
                                            float (&acc)[kPfMW][BR / 8][4], u8* smem) {
  constexpr int N8 = BR / 8, CB = St::kCB, MW = kPfMW;
  constexpr bool kScaled = QA::kBlock != 0;
  constexpr int NSB = MetaLayout<typename QA::Scale, QA::kBlock, ZPW>::NSB;
  using D = MmaDeq<T, B, QA::kZp>;
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const i32 nch = (K + kPfChunk - 1) / kPfChunk;
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  i64 sba[MW], sbb[MW];  // scale index of block 0 of each lane row
#pragma unroll
  for (int m = 0; m < MW; ++m) {
    sba[m] = LaneMeta<QA, ZPW>::base(qa, e, lr.na[m]);
    sbb[m] = LaneMeta<QB, ZPW>::base(qb, e, lr.nb[m]);
  }

  auto issue = [&](i32 slot, i32 c) {
    const u32 base = s0 + slot * St::kBytes;
    for (int i = threadIdx.x; i < BR * 16; i += kPfThreads) {  // activations: BR rows × 16 units
      const int r = i >> 4, u = i & 15;
      const i32 k = c * kPfChunk + u * 8;
      const i64 so = s_src[r];
      const bool ok = so >= 0 && k < K;
      cp_async(base + r * 256 + ((u ^ pf_swizzle(u, r)) << 4), ok ? src + so + k : src, 16, ok);
    }
    const u32 wbase = base + St::kXBytes + warp * St::kWarpBytes;
    const i32 k0 = c * kPfChunk + 32 * t;
    const bool live = k0 < K;
    const i64 off = live ? CodeRows<B>::seg(k0 / 32) : 0;
    const i32 j = live ? QA::block_of(k0) : 0;
#pragma unroll
    for (int m = 0; m < MW; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const u8* p = (r ? lr.pb[m] : lr.pa[m]) + off;
        const u32 dst = wbase + ((m * 2 + r) * 32 + lane) * CB;
        cp_async_codes<CB>(dst, p, live);
        if constexpr (kScaled) {
          const u32 meta = wbase + St::kWarpCodes + ((m * 2 + r) * St::kWords) * 128 + LaneMeta<QA, ZPW>::lane_bytes(lane);
          if (r) LaneMeta<QB, ZPW>::issue(qb, sbb[m], e, lr.nb[m], j, meta, live, lr.pa[m]);
          else LaneMeta<QA, ZPW>::issue(qa, sba[m], e, lr.na[m], j, meta, live, lr.pa[m]);
        }
      }
    }
  };

  auto compute = [&](i32 slot, i32 c) {
    const u8* st = smem + slot * St::kBytes;
    const u8* wst = st + St::kXBytes + warp * St::kWarpBytes;
    const i32 k0 = c * kPfChunk + 32 * t;
    const bool live = k0 < K;  // lanes past K hold zero-filled codes and activations
    const i32 j0 = live ? QA::block_of(k0) : 0;
    u32 a[MW][8][4];
#pragma unroll
    for (int m = 0; m < MW; ++m) {
      u32 ra[B], rb[B];
      Coef ca[NSB], cb[NSB];
      const u32* ma = reinterpret_cast<const u32*>(wst + St::kWarpCodes + LaneMeta<QA, ZPW>::lane_bytes(lane)) +
                      ((m * 2 + 0) * St::kWords) * 32;
      lane_tile_load<T, B, St::kWords, ZPW>(wst + ((m * 2 + 0) * 32 + lane) * CB, wst + ((m * 2 + 1) * 32 + lane) * CB,
                                            ma, qa, sba[m], lr.na[m], lr.rca[m], qb, sbb[m], lr.nb[m], lr.rcb[m], e,
                                            j0, live, ra, rb, ca, cb);
#pragma unroll
      for (int s = 0; s < 8; ++s) D::template fragment<kScaled, NSB>(a[m][s], ra, rb, ca, cb, s);
    }
#pragma unroll
    for (int jn = 0; jn < N8; ++jn) {
      const int r = 8 * jn + g;
      u32 xw[16];
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int u = 4 * t + v;
        const uint4 q = *reinterpret_cast<const uint4*>(st + r * 256 + ((u ^ pf_swizzle(u, r)) << 4));
        xw[4 * v] = q.x; xw[4 * v + 1] = q.y; xw[4 * v + 2] = q.z; xw[4 * v + 3] = q.w;
      }
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const u32 b0 = D::x_pair(xw, 2 * s), b1 = D::x_pair(xw, 2 * s + 1);
#pragma unroll
        for (int m = 0; m < MW; ++m) Pair2<T>::mma(acc[m][jn], a[m][s], b0, b1);
      }
    }
  };

  constexpr int S = kPfStages;
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (i < nch) issue(i, i);
    cp_async_commit();  // empty groups keep the count uniform
  }
  for (i32 c = 0; c < nch; ++c) {
    cp_async_wait<S - 2>();  // this thread's copies of stage c have landed
    __syncthreads();         // everyone's have, and every warp is done with the slot issued next
    const i32 cn = c + S - 1;
    if (cn < nch) issue(cn % S, cn);
    cp_async_commit();
    compute(c % S, c);
  }
  cp_async_wait<0>();
}

// FC1 (+FC3) with the activation fused: act_sorted[m, o] for the tile's routes. Warp tile = 8 outputs
// (gated: rows g = gate, g + 8 = linear of output g) or 16 outputs (plain).
template <int GATE, typename T, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int ACT, int BR>
__global__ void __launch_bounds__(kPfThreads, kPfMinBlocks)
fc1_prefill(const T* __restrict__ x, const RouteGroups rg, i32 E, i32 k, i32 H, i32 I, i32 NT, i32 G,
            const Fc1Weights<ScaleT> wt, const ActParams ap, T* __restrict__ act_sorted) {
  using Rows = Fc1Rows<GATE>;
  constexpr bool kZpw = Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED);
  using St = PfStage<B1, ScaleT, BLOCK, kZpw, BR>;
  constexpr int N8 = BR / 8, kOut = Rows::kGated ? 8 : 16;
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ i64 s_src[BR];
  pf_check_smem<St, 1, BR>();
  i32 nt, e, m0, m_end;
  if (!pf_tile<BR>(rg.offsets, rg.tile_offsets, E, NT, G, nt, e, m0, m_end)) return;
  const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
  const Proj<ScaleT>& p3 = wt.fc3;
  const i32 N1 = Rows::n1(I);
  using Q1 = QuantParams<ScaleT, B1, BLOCK, Z1>;
  using Q3 = QuantParams<ScaleT, B1, BLOCK, Z3>;
  using Second = PfSecond<GATE == GATE_FC3, Q1, Q3>;
  using QB = typename Second::type;
  const Q1 q1{p1.scales, p1.zp, wt.zp_offset, N1, H, Rows::kInterleavedTiles};
  const Q3 q3{p3.scales, p3.zp, wt.zp_offset, I, H};
  const QB& qb = Second::pick(q1, q3);
  const u8* wb = GATE == GATE_FC3 ? p3.w : p1.w;
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  i32 o0[kPfMW];
  PfLaneRows<T, Q1, QB, kPfMW> lr;
#pragma unroll
  for (int m = 0; m < kPfMW; ++m) {
    o0[m] = (nt * kPfTiles + warp * kPfMW + m) * kOut;
    const i32 oa = min(o0[m] + g, I - 1), ob = Rows::kGated ? oa : min(o0[m] + g + 8, I - 1);  // clamped: never stored
    const i32 na = Rows::gate_row(oa, I), nb = Rows::kGated ? Rows::lin_row(oa, I) : ob;
    lr.set(m, q1, p1.w, na, Rows::tile_row(na), qb, wb, nb, Rows::tile_row(nb), e);
  }
  for (int i = threadIdx.x; i < BR; i += kPfThreads) s_src[i] = m0 + i < m_end ? (i64)(rg.sorted[m0 + i] / k) * H : -1;
  __syncthreads();
  float acc[kPfMW][N8][4] = {};
  pf_mainloop<T, B1, BR, kZpw, Q1, QB, St>(q1, qb, lr, e, x, s_src, H, acc, dyn_smem);
  // A thread's outputs are the same for every route of the tile: their biases are read once, here
  // (clamped: an output past I is never stored).
  Fc1Bias ba[kPfMW], bb[kPfMW];
#pragma unroll
  for (int m = 0; m < kPfMW; ++m) {
    ba[m] = fc1_bias<GATE>(p1.bias, p3.bias, e, min(o0[m] + g, I - 1), I);
    bb[m] = Rows::kGated ? ba[m] : fc1_bias<GATE>(p1.bias, p3.bias, e, min(o0[m] + g + 8, I - 1), I);
  }
#pragma unroll
  for (int m = 0; m < kPfMW; ++m) {
#pragma unroll
    for (int jn = 0; jn < N8; ++jn) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const i32 pos = m0 + 8 * jn + 2 * t + cc;
        if (pos >= m_end) continue;
        T* out = act_sorted + (i64)pos * I;
        fc1_store_lane<ACT, GATE, T>(acc[m][jn][cc] * lr.sa[m], acc[m][jn][2 + cc] * lr.sb[m], o0[m] + g, I, I,  // rows g, g + 8
                                     [&](int h) { return h ? bb[m] : ba[m]; }, ap, [&](i32 n, T v) { out[n] = v; });
      }
    }
  }
}

// FC2: y[route, n] = act_sorted[m] · W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__global__ void __launch_bounds__(kPfThreads, kPfMinBlocks)
fc2_prefill(const T* __restrict__ act_sorted, const RouteGroups rg, i32 E, i32 H, i32 I, i32 NT, i32 G,
            const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  constexpr bool kZpw = Z2 == ZP_PACKED;
  using St = PfStage<B2, ScaleT, BLOCK, kZpw, BR>;
  constexpr int N8 = BR / 8;
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ i64 s_src[BR];
  pf_check_smem<St, 2, BR>();
  i32 nt, e, m0, m_end;
  if (!pf_tile<BR>(rg.offsets, rg.tile_offsets, E, NT, G, nt, e, m0, m_end)) return;
  const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
  using Q2 = QuantParams<ScaleT, B2, BLOCK, Z2>;
  const Q2 q2{p2.scales, p2.zp, wt.zp_offset, H, I};
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  i32 n0[kPfMW];
  PfLaneRows<T, Q2, Q2, kPfMW> lr;
#pragma unroll
  for (int m = 0; m < kPfMW; ++m) {
    n0[m] = (nt * kPfTiles + warp * kPfMW + m) * 16;
    const i32 na = min(n0[m] + g, H - 1), nb = min(n0[m] + g + 8, H - 1);  // clamped: never stored
    lr.set(m, q2, p2.w, na, na, q2, p2.w, nb, nb, e);
  }
  for (int i = threadIdx.x; i < BR; i += kPfThreads) s_src[i] = m0 + i < m_end ? (i64)(m0 + i) * I : -1;
  __syncthreads();
  float acc[kPfMW][N8][4] = {};
  pf_mainloop<T, B2, BR, kZpw, Q2, Q2, St>(q2, q2, lr, e, act_sorted, s_src, I, acc, dyn_smem);
  // Read once, not per stored value: the biases of a thread's rows (the same for every route) and the
  // route ids of its positions (clamped loads with no branch between them, so they are in flight together).
  float bias_a[kPfMW], bias_b[kPfMW];
#pragma unroll
  for (int m = 0; m < kPfMW; ++m) {
    bias_a[m] = p2.bias ? __ldg(p2.bias + (i64)e * H + min(n0[m] + g, H - 1)) : 0.0f;
    bias_b[m] = p2.bias ? __ldg(p2.bias + (i64)e * H + min(n0[m] + g + 8, H - 1)) : 0.0f;
  }
  i32 route[N8][2];
#pragma unroll
  for (int jn = 0; jn < N8; ++jn) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) route[jn][cc] = __ldg(rg.sorted + min(m0 + 8 * jn + 2 * t + cc, m_end - 1));
  }
#pragma unroll
  for (int m = 0; m < kPfMW; ++m) {
#pragma unroll
    for (int jn = 0; jn < N8; ++jn) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const i32 pos = m0 + 8 * jn + 2 * t + cc;
        if (pos >= m_end) continue;
        float* out = y + (i64)route[jn][cc] * H;
        const i32 n = n0[m] + g;
        fc2_store_lane(
            n, H, [&](int h) { return h ? acc[m][jn][2 + cc] * lr.sb[m] + bias_b[m] : acc[m][jn][cc] * lr.sa[m] + bias_a[m]; },
            [&](i32 i, float v) { out[i] = v; });
      }
    }
  }
}

}  // namespace qmoe
