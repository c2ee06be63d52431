// engines/wgmma_ws.cuh: the Hopper prefill engine, warp-specialised and persistent (sm_90a): the grouped
// GEMMs of engines/wgmma_prefill.cuh (same exact dequantization, same K order) with the copies and the
// MMAs in different warps and the activations as route-tile images (core/wg_order.cuh).
//
//   rg (RouteGroups)                  routing/group.cuh, route tiles of BR routes (64, 128; 256 with one
//                                     m16 tile per MMA warp)
//   x           [rows, H]        T     the call's input
//   xs          [Hp / 64][Rp][64] T    x gathered in sorted order as a route-tile image (ws_gather)
//   act_sorted  [Ip / 64][Rp][64] T    FC1 out, the route-tile image FC2 reads (zeros for I <= o < Ip)
//   y           [R, H]           f32  FC2 out by route id, bias added (the combine applies the weights)
//
// Block: kWsConsumers MMA warpgroups + one copy warpgroup, one block per SM walking the tile list
// (pf_tile_at: G route tiles of a weight tile, then the next weight tile) with a stride of the grid.
//   copy warpgroup   fills a ring of St::kStages stages. Warp 0 announces the route tile's bytes on the
//                    stage's `full` barrier and copies its two half chunks with two bulk copies
//                    (cp.async.bulk; each one contiguous run of the image). On tiled codes each lane row
//                    group's codes (one run of 128·B bytes) and meta records (one run per chunk) are
//                    copied by one warp with cp.async, 16 bytes a lane (a bulk copy per run measured
//                    slower: the copy unit takes small requests one at a time); contract-layout codes or
//                    scales (FP8 block scales) go lane by lane. Every copy thread then arrives on `full`
//                    when its cp.async copies land; the stage is refilled after its `empty` barrier
//                    completes. The warpgroup gives its registers to the MMA warps (setmaxnreg).
//   MMA warp w       kWsMW m16 weight tiles (tile w·MW + m: rows g and g + 8 of the tile, the lane
//                    layout of the other tensor-core engines), one m64nBRk16 MMA per tile and k16 step,
//                    A dequantized in registers, B the stage's route tile; acc[MW][BR / 2] f32.
// The ring runs across tiles, so the next tile's first chunks are copied while the MMA warps finish a
// tile and store it. A stage is released when the MMAs that read it are done (the wait of the next
// chunk's first step).
#pragma once

#include "core/experts.cuh"
#include "core/types.cuh"
#include "core/wg_order.cuh"
#include "engines/tile_rows.cuh"
#include "engines/wg_image.cuh"
#include "engines/ws_pipeline.cuh"
#include "epilogue/combine.cuh"
#include "epilogue/fc1.cuh"
#include "routing/group.cuh"

namespace qmoe {

// xs = the route-tile image of x (engines/wg_image.cuh): one block per kGatherRows sorted rows.
template <typename T, int B>
__global__ void __launch_bounds__(256)
ws_gather(const T* __restrict__ x, const RouteGroups rg, i32 E, i32 k, i32 H, i32 Hp, i32 Rp, T* __restrict__ xs) {
  gather_image_rows<T, B>(x, rg, E, k, H, Hp, Rp, xs);
}

// FC1 (+FC3) with the activation fused: act_sorted's image at (m, wg_pos<B2>(o)) for the tile's routes (B2:
// FC2's bits, whose order FC2 reads), zeros for I <= o < Ip. Weight tile = 8 outputs (gated) or 16 (plain).
template <int GATE, typename T, typename ScaleT, int B1, int B2, int Z1, int Z3, int BLOCK, int ACT, int BR>
__global__ void __launch_bounds__(kWsThreads, 1)
fc1_wgws(const T* __restrict__ xs, const RouteGroups rg, i32 E, i32 H, i32 Hp, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G,
         const Fc1Weights<ScaleT> wt, const ActParams ap, T* __restrict__ act_sorted) {
  using Rows = Fc1Rows<GATE>;
  constexpr bool kZpw = Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED);
  using St = WsStage<B1, ScaleT, BLOCK, kZpw, BR>;
  using Q1 = QuantParams<ScaleT, B1, BLOCK, Z1>;
  using Q3 = QuantParams<ScaleT, B1, BLOCK, Z3>;
  using Second = PfSecond<GATE == GATE_FC3, Q1, Q3>;
  using QB = typename Second::type;
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ __align__(8) u64 bars[2 * St::kStages];
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  WsRing<St::kStages> ring = ws_ring<St::kStages>(bars);
  const i32 total = pf_tile_count(rg.tile_offsets, E, NT, G);
  auto row_of = [I](i32 tile, i32 g) { return ws_fc1_row<GATE>(tile, g, I); };
  const Proj<ScaleT>& p3 = wt.fc3;  // GATE_FC3 only

  if (threadIdx.x >= kWsMmaThreads) {  // the copy warpgroup
    ws_regs_dec<kWsCopyRegs>();
    for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
      i32 nt, e, m0, m_end;
      if (!pf_tile_at<BR>(idx, rg.offsets, rg.tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
      const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
      const Q1 q1{p1.scales, p1.zp, wt.zp_offset, Rows::n1(I), H, Rows::kInterleavedTiles};
      const Q3 q3{p3.scales, p3.zp, wt.zp_offset, I, H};
      ws_produce<T, B1, BR, kZpw, Q1, QB, St>(q1, Second::pick(q1, q3), p1.w, GATE == GATE_FC3 ? p3.w : p1.w, e, nt, m0,
                                              row_of, xs, Rp, H, Hp, s0, ring);
    }
    cp_async_wait<0>();
    return;
  }

  ws_regs_inc<kWsMmaRegs>();
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  i32 held = -1;
  for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
    i32 nt, e, m0, m_end;
    if (!pf_tile_at<BR>(idx, rg.offsets, rg.tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
    const Proj<ScaleT> p1 = expert_proj(e, wt.E_routed, wt.fc1, wt.shared_fc1);
    const Q1 q1{p1.scales, p1.zp, wt.zp_offset, Rows::n1(I), H, Rows::kInterleavedTiles};
    const Q3 q3{p3.scales, p3.zp, wt.zp_offset, I, H};
    const QB& qb = Second::pick(q1, q3);
    const u8* wb = GATE == GATE_FC3 ? p3.w : p1.w;
    PfLaneRows<T, Q1, QB, kWsMW> lr;
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const WsRow rw = row_of(nt * kWsTiles + warp * kWsMW + m, g);
      lr.set(m, q1, p1.w, rw.na, rw.ma, qb, wb, rw.nb, rw.mb, e);
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
      // the same outputs for every route of the tile: their biases read once (clamped: past I never stored)
      const Fc1Bias ba = fc1_bias<GATE>(p1.bias, p3.bias, e, min(o, I - 1), I);
      const Fc1Bias bb = Rows::kGated ? ba : fc1_bias<GATE>(p1.bias, p3.bias, e, min(o + 8, I - 1), I);
#pragma unroll
      for (int jn = 0; jn < BR / 8; ++jn) {
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          const i32 pos = m0 + 8 * jn + 2 * t + cc;
          if (pos >= m_end) continue;
          const float ha = acc[m][4 * jn + cc] * lr.sa[m], hb = acc[m][4 * jn + 2 + cc] * lr.sb[m];  // rows g, g + 8
          const i32 swz = (pos - m0) & 7;
          if constexpr (Rows::kGated) {
            if (o < Ip)
              act_sorted[img_index(pos, swz, wg_pos<B2>(o), Rp)] =
                  Traits<T>::from_float(o < I ? fc1_apply<ACT, GATE>(ha, hb, ba, ap) : 0.0f);
          } else {
            if (o < Ip)
              act_sorted[img_index(pos, swz, wg_pos<B2>(o), Rp)] =
                  Traits<T>::from_float(o < I ? fc1_apply<ACT, GATE>(ha, 0.0f, ba, ap) : 0.0f);
            if (o + 8 < Ip)
              act_sorted[img_index(pos, swz, wg_pos<B2>(o + 8), Rp)] =
                  Traits<T>::from_float(o + 8 < I ? fc1_apply<ACT, GATE>(hb, 0.0f, bb, ap) : 0.0f);
          }
        }
      }
    }
  }
}

// FC2: y[route, n] = act_sorted[m] · W2[e, n] + b2[e, n] for the tile's routes (scattered by route id).
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int BR>
__global__ void __launch_bounds__(kWsThreads, 1)
fc2_wgws(const T* __restrict__ act_sorted, const RouteGroups rg, i32 E, i32 H, i32 I, i32 Ip, i32 Rp, i32 NT, i32 G,
         const Fc2Weights<ScaleT> wt, float* __restrict__ y) {
  constexpr bool kZpw = Z2 == ZP_PACKED;
  using St = WsStage<B2, ScaleT, BLOCK, kZpw, BR>;
  using Q2 = QuantParams<ScaleT, B2, BLOCK, Z2>;
  extern __shared__ __align__(16) u8 dyn_smem[];
  __shared__ __align__(8) u64 bars[2 * St::kStages];
  u8* smem = wg_smem<St::kStages * St::kBytes>(dyn_smem);
  const u32 s0 = (u32)__cvta_generic_to_shared(smem);
  WsRing<St::kStages> ring = ws_ring<St::kStages>(bars);
  const i32 total = pf_tile_count(rg.tile_offsets, E, NT, G);
  auto row_of = [H](i32 tile, i32 g) { return ws_fc2_row(tile, g, H); };

  if (threadIdx.x >= kWsMmaThreads) {  // the copy warpgroup
    ws_regs_dec<kWsCopyRegs>();
    for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
      i32 nt, e, m0, m_end;
      if (!pf_tile_at<BR>(idx, rg.offsets, rg.tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
      const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
      const Q2 q2{p2.scales, p2.zp, wt.zp_offset, H, I};
      ws_produce<T, B2, BR, kZpw, Q2, Q2, St>(q2, q2, p2.w, p2.w, e, nt, m0, row_of, act_sorted, Rp, I, Ip, s0, ring);
    }
    cp_async_wait<0>();
    return;
  }

  ws_regs_inc<kWsMmaRegs>();
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  i32 held = -1;
  for (i32 idx = blockIdx.x; idx < total; idx += gridDim.x) {
    i32 nt, e, m0, m_end;
    if (!pf_tile_at<BR>(idx, rg.offsets, rg.tile_offsets, E, NT, G, nt, e, m0, m_end)) continue;
    const Proj<ScaleT> p2 = expert_proj(e, wt.E_routed, wt.fc2, wt.shared_fc2);
    const Q2 q2{p2.scales, p2.zp, wt.zp_offset, H, I};
    PfLaneRows<T, Q2, Q2, kWsMW> lr;
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const WsRow rw = row_of(nt * kWsTiles + warp * kWsMW + m, g);
      lr.set(m, q2, p2.w, rw.na, rw.ma, q2, p2.w, rw.nb, rw.mb, e);
    }
    float acc[kWsMW][BR / 2];
#pragma unroll
    for (int m = 0; m < kWsMW; ++m)
#pragma unroll
      for (int i = 0; i < BR / 2; ++i) acc[m][i] = 0.0f;
    ws_consume<T, B2, BR, kZpw, Q2, Q2, St>(q2, q2, lr, e, I, Ip, acc, smem, s0, ring, held);
    // Read once, not per stored value: the biases of the thread's rows (the same for every route; clamped,
    // past H never stored) and each position's route id (a load with no branch before it).
    float bias_a[kWsMW], bias_b[kWsMW];
#pragma unroll
    for (int m = 0; m < kWsMW; ++m) {
      const i32 n = (nt * kWsTiles + warp * kWsMW + m) * 16 + g;
      bias_a[m] = p2.bias ? __ldg(p2.bias + (i64)e * H + min(n, H - 1)) : 0.0f;
      bias_b[m] = p2.bias ? __ldg(p2.bias + (i64)e * H + min(n + 8, H - 1)) : 0.0f;
    }
#pragma unroll
    for (int jn = 0; jn < BR / 8; ++jn) {
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {
        const i32 pos = m0 + 8 * jn + 2 * t + cc;
        float* out = y + (i64)__ldg(rg.sorted + min(pos, m_end - 1)) * H;
        if (pos >= m_end) continue;
#pragma unroll
        for (int m = 0; m < kWsMW; ++m) {
          const i32 n = (nt * kWsTiles + warp * kWsMW + m) * 16 + g;
          if (n < H) out[n] = acc[m][4 * jn + cc] * lr.sa[m] + bias_a[m];
          if (n + 8 < H) out[n + 8] = acc[m][4 * jn + 2 + cc] * lr.sb[m] + bias_b[m];
        }
      }
    }
  }
}

}  // namespace qmoe
