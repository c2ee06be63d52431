// engines/wg_ahead.cuh: the wgmma prefill GEMMs' weights brought into L2 ahead of the block that will copy them
// (engines/wgmma_prefill.cuh), and the lane rows of a GEMM's weight tile, which both the GEMMs and the prefetch take.
//
// A block of one tile copies its weights only from its own start: its first chunks cross from DRAM while it looks up
// its tile and fills its ring, and from its last copy to its exit (the ring's last chunks, the epilogue) it has no
// bytes in flight. Blocks start in grid order, as SMs free up, so the block that starts when this one leaves is about
// AH blocks on, AH the blocks of the launch the device holds at once (the host's, by the driver's occupancy of the
// launch: jit Launch.resident). Right after its last copy a block brings that block's first kWgAhead chunks of codes
// and scales into L2 (prefetch hints: nothing waits for them, a wrong guess costs bandwidth, never a result), so its
// successor's first copies are L2 hits and the DRAM queue stays fed across the hand-over. FC2's blocks also prefetch
// their own first chunks before they wait for FC1, under FC1's last round. kWgAhead = 0 (the host's knob
// prefill_wg_ahead, a define): none of it compiled.
#pragma once

#include "core/codes.cuh"
#include "core/cp_async.cuh"
#include "core/lane_meta.cuh"
#include "core/types.cuh"
#include "engines/tile_rows.cuh"
#include "engines/wg_tiles.cuh"
#include "epilogue/fc1.cuh"
#include "routing/group.cuh"

namespace qmoe {

#ifndef QMOE_WG_AHEAD
#define QMOE_WG_AHEAD 0
#endif
inline constexpr int kWgAhead = QMOE_WG_AHEAD;  // chunks of K prefetched for another block (knob prefill_wg_ahead)
static_assert(kWgAhead >= 0 && kWgAhead <= 16, "QMOE_WG_AHEAD: 0 to 16 chunks");
#ifndef QMOE_WG_AHEAD_END
#define QMOE_WG_AHEAD_END 0
#endif
// (experiment) the prefetch once the main loop is done instead of right after its last copy: fewer registers
inline constexpr bool kWgAheadAtEnd = QMOE_WG_AHEAD_END;

// The lines the main loop's copies of chunks [c0, c0 + kWgAhead) of this lane's two rows read (codes, and with
// block-wise scales their meta), brought into L2: the addresses wg_mainloop's issue() copies from. K: the rows'
// codes (lanes past it read nothing).
template <int B, bool ZPW, typename T, class QA, class QB>
__device__ __forceinline__ void wg_prefetch(const QA& qa, const QB& qb, const PfLaneRows<T, QA, QB, 1>& lr, i32 e, i32 K,
                                            i32 c0) {
  const i32 t = threadIdx.x & 3;
  const i64 sba = LaneMeta<QA, ZPW>::base(qa, e, lr.na[0]), sbb = LaneMeta<QB, ZPW>::base(qb, e, lr.nb[0]);
#pragma unroll
  for (int i = 0; i < kWgAhead; ++i) {
    const i32 k0 = (c0 + i) * 128 + 32 * t;
    if (k0 >= K) break;
    const i64 off = CodeRows<B>::seg(k0 / 32);
    prefetch_l2(lr.pa[0] + off);
    prefetch_l2(lr.pb[0] + off);
    if constexpr (QA::kBlock != 0) {
      const i32 j = QA::block_of_u(k0);
      LaneMeta<QA, ZPW>::prefetch(qa, sba, e, lr.na[0], j);
      LaneMeta<QB, ZPW>::prefetch(qb, sbb, e, lr.nb[0], j);
    }
  }
}

// The expert and weight tile of grid block idx (grid_tile's order; its routes are not needed): from the tile table from
// kTableExperts experts, else the search over the experts' tile ranges. False past the call's route tiles.
template <int CL = 1>
__device__ __forceinline__ bool wg_tile_expert(i32 idx, const i32* __restrict__ tile_offsets, i32 E, i32 NT, i32 G,
                                               const i32* __restrict__ tile_info, i32& nt, i32& e) {
  const i32 t = grid_tile<CL>(idx, NT, G, nt);
  if (t >= tile_offsets[E]) return false;
  e = E < kTableExperts ? expert_at<false>(tile_offsets, E, t) : tile_info[4 * (i64)t];
  return true;
}

// A lane's two rows of FC1's weight tile nt (kWarps warps a block) of expert e: the gate / linear rows of its output
// (clamped past I: never stored), or two outputs 8 apart ungated.
template <int GATE, int kWarps, typename T, class Q1, class QB>
__device__ __forceinline__ void fc1_lane_rows(PfLaneRows<T, Q1, QB, 1>& l, const Q1& qa, const u8* wa, const QB& qb, const u8* wb,
                                              i32 nt, i32 e, i32 I) {
  using Rows = Fc1Rows<GATE>;
  constexpr int kOut = Rows::kGated ? 8 : 16;
  const i32 warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const i32 o = (nt * kWarps + warp) * kOut;
  const i32 oa = min(o + g, I - 1), ob = Rows::kGated ? oa : min(o + g + 8, I - 1);
  const i32 na = Rows::gate_row(oa, I), nb = Rows::kGated ? Rows::lin_row(oa, I) : ob;
  l.set(0, qa, wa, na, Rows::tile_row(na), qb, wb, nb, Rows::tile_row(nb), e);
}

// The prefetch of FC1's weight tile nt of expert e (its projection pa, FC3's p3) for another block (engines/wg_ahead.cuh),
// out of line, so that its registers are not counted into the main loop's.
template <int GATE, typename T, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int kWarps, bool kZpw>
__device__ __noinline__ void fc1_ahead(const Proj<ScaleT> pa, const Proj<ScaleT> p3, float zp_offset, i32 e, i32 nt, i32 H,
                                       i32 I) {
  using Rows = Fc1Rows<GATE>;
  using Q1 = QuantParams<ScaleT, B1, BLOCK, Z1>;
  using Q3 = QuantParams<ScaleT, B1, BLOCK, Z3>;
  using Second = PfSecond<GATE == GATE_FC3, Q1, Q3>;
  using QB = typename Second::type;
  const Q1 qa{pa.scales, pa.zp, zp_offset, Rows::n1(I), H, Rows::kInterleavedTiles};
  const Q3 q3{p3.scales, p3.zp, zp_offset, I, H};
  const QB& qb = Second::pick(qa, q3);
  PfLaneRows<T, Q1, QB, 1> l;
  fc1_lane_rows<GATE, kWarps>(l, qa, pa.w, qb, GATE == GATE_FC3 ? p3.w : pa.w, nt, e, I);
  wg_prefetch<B1, kZpw>(qa, qb, l, e, H, 0);
}

// A lane's two rows of FC2's weight tile nt (kWarps warps a block) of expert e: outputs 8 apart (clamped past H: never
// stored).
template <int kWarps, typename T, class Q2>
__device__ __forceinline__ void fc2_lane_rows(PfLaneRows<T, Q2, Q2, 1>& l, const Q2& q, const u8* w, i32 nt, i32 e, i32 H) {
  const i32 n = (nt * kWarps + (i32)(threadIdx.x >> 5)) * 16 + (i32)((threadIdx.x & 31) >> 2);
  l.set(0, q, w, min(n, H - 1), min(n, H - 1), q, w, min(n + 8, H - 1), min(n + 8, H - 1), e);
}

// The prefetch of FC2's weight tile nt of expert e (its projection p) from chunk c0 for a block (engines/wg_ahead.cuh),
// out of line, so that its registers are not counted into the main loop's.
template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int kWarps, bool kZpw>
__device__ __noinline__ void fc2_ahead(const Proj<ScaleT> p, float zp_offset, i32 e, i32 nt, i32 H, i32 I, i32 c0) {
  using Q2 = QuantParams<ScaleT, B2, BLOCK, Z2>;
  const Q2 q{p.scales, p.zp, zp_offset, H, I};
  PfLaneRows<T, Q2, Q2, 1> l;
  fc2_lane_rows<kWarps>(l, q, p.w, nt, e, H);
  wg_prefetch<B2, kZpw>(q, q, l, e, I, c0);
}

// The hook wg_mainloop calls once, right after a tile's last copy (NoAhead: none).
struct NoAhead {
  __device__ __forceinline__ void operator()() const {}
};

}  // namespace qmoe
