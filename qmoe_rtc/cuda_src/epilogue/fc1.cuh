// epilogue/fc1.cuh: the FC1 epilogue every FC1 kernel shares -- which weight rows feed output o, and
// the biases + activation that turn their pre-activations into act[o].
//
//   GATE_NONE:   act[o] = act1(h[o] + b1[o])                       FC1 rows N1 = I
//   GATE_FUSED1: gate row 2o, linear row 2o + 1 of FC1             N1 = 2I
//   GATE_FUSED2: gate row o, linear row I + o of FC1               N1 = 2I
//   GATE_FC3:    gate row o of FC1, linear row o of FC3            N1 = I
//   gated:       act[o] = act_gated(h_gate + b_gate, h_lin + b_lin)
// Tiled codes of a layer with swiglu_fusion=2 are tiled in GATE_FUSED1's order and its FC1 bias moved to
// that order at upload (qmoe_rtc/tiled/transform.py fc1_fusion, fusion1_order), so they compile as GATE_FUSED1;
// GATE_FUSED2 is the contract layout's (and tiled FP8 codes', which keep their rows).
#pragma once

#include "core/codes.cuh"
#include "core/types.cuh"
#include "epilogue/act.cuh"

namespace qmoe {

template <int GATE> struct Fc1Rows {
  static constexpr bool kGated = GATE != GATE_NONE;
  static constexpr bool kFused = GATE == GATE_FUSED1 || GATE == GATE_FUSED2;
  // rows of FC1 per expert
  static __device__ __forceinline__ i32 n1(i32 I) { return kFused ? 2 * I : I; }
  // FC1 row of the gate (or plain) half of output o
  static __device__ __forceinline__ i32 gate_row(i32 o, i32 I) { return GATE == GATE_FUSED1 ? 2 * o : o; }
  // row of the linear half of output o: in FC1 (fused), in FC3 (GATE_FC3)
  static __device__ __forceinline__ i32 lin_row(i32 o, i32 I) {
    return GATE == GATE_FUSED1 ? 2 * o + 1 : (GATE == GATE_FUSED2 ? I + o : o);
  }
  // tile row of FC1 row n in the tiled layout (core/codes.cuh): interleaved rows (GATE_FUSED1) put the
  // 8 gate rows of outputs 8q .. 8q + 7 in tile rows 16q .. 16q + 7 and their linear rows in 16q + 8 ..
  // 16q + 15, so each lane row of a gated warp tile is a whole row group; otherwise the row itself
  static constexpr bool kInterleavedTiles = kTiled && GATE == GATE_FUSED1;  // FC1's QuantParams::il
  // a warp tile's lane rows are rows g and g + 8 of one 16-row tile of FC1 (engines/mma_ring.cuh PAIRED)
  static constexpr bool kPairedRows = GATE == GATE_NONE || kInterleavedTiles;
  static __device__ __forceinline__ i32 tile_row(i32 n) {
    if constexpr (kInterleavedTiles) return ((n >> 4) << 4) + ((n & 1) << 3) + ((n >> 1) & 7);
    else return n;
  }
};

// The biases of output o of expert e: its gate (or plain) row's and, when gated, its linear row's
// (b1 [E, N1] f32, b3 [E, I] f32, either may be null; read-only, hence __ldg). They depend on o only, so
// a kernel that activates many routes of one output fetches them once (fc1_apply), not per route.
struct Fc1Bias {
  float g, l;
};
template <int GATE>
__device__ __forceinline__ Fc1Bias fc1_bias(const float* __restrict__ b1, const float* __restrict__ b3, i32 e, i32 o,
                                            i32 I) {
  using R = Fc1Rows<GATE>;
  const i64 base1 = (i64)e * R::n1(I);
  Fc1Bias b{b1 ? __ldg(b1 + base1 + R::gate_row(o, I)) : 0.0f, 0.0f};
  if constexpr (GATE == GATE_FC3) b.l = b3 ? __ldg(b3 + (i64)e * I + o) : 0.0f;
  else if constexpr (R::kGated) b.l = b1 ? __ldg(b1 + base1 + R::lin_row(o, I)) : 0.0f;
  return b;
}

// act[o] from the pre-activation h of its gate (or plain) row and, when gated, lin of its linear row,
// with its biases b.
template <int ACT, int GATE>
__device__ __forceinline__ float fc1_apply(float h, float lin, Fc1Bias b, const ActParams& ap) {
  if constexpr (!Fc1Rows<GATE>::kGated) return act1<ACT>(h + b.g);
  else return act_gated<ACT>(h + b.g, lin + b.l, ap);
}

// act[o] of expert e: fc1_apply with the biases fetched here.
template <int ACT, int GATE>
__device__ __forceinline__ float fc1_activation(float h, float lin, const float* __restrict__ b1,
                                                const float* __restrict__ b3, i32 e, i32 o, i32 I,
                                                const ActParams& ap) {
  return fc1_apply<ACT, GATE>(h, lin, fc1_bias<GATE>(b1, b3, e, o, I), ap);
}

// The FC1 epilogue of every tensor-core engine: a lane's outputs of one route from its C-fragment pair (rows g and
// g + 8 of a 16-row weight tile), each rounded to T and handed to store(o, value). Gated rows (gate, linear) give
// output o from (ha, hb); plain rows give outputs o from ha and o + 8 from hb. Outputs from `limit` on are not stored,
// those from I to `limit` (padding columns a later GEMM reads) are stored as zeros. bias(h) is the biases of the
// lane's output h (0: o, 1: o + 8; fetched there, or the caller's, read once for every route of a tile); where output
// o of the route goes is the caller's (store: its layout's index).
template <int ACT, int GATE, typename T, class Bias, class Store>
__device__ __forceinline__ void fc1_store_lane(float ha, float hb, i32 o, i32 I, i32 limit, Bias&& bias,
                                               const ActParams& ap, Store&& store) {
  if constexpr (Fc1Rows<GATE>::kGated) {
    if (o < limit) store(o, Traits<T>::from_float(o < I ? fc1_apply<ACT, GATE>(ha, hb, bias(0), ap) : 0.0f));
  } else {
    if (o < limit) store(o, Traits<T>::from_float(o < I ? fc1_apply<ACT, GATE>(ha, 0.0f, bias(0), ap) : 0.0f));
    if (o + 8 < limit) store(o + 8, Traits<T>::from_float(o + 8 < I ? fc1_apply<ACT, GATE>(hb, 0.0f, bias(1), ap) : 0.0f));
  }
}

}  // namespace qmoe
