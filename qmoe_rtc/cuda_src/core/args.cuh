// core/args.cuh: the argument structs of the expert kernels, passed by value.
//
// One declaration each. The Python argument specs mirror them member by member, in this order
// (qmoe_rtc/kernels/_expert.py builds them), and tests/kernels/test_kernel_args.py reads this file to
// check that they do. NVVM ignores __restrict__ on struct members, so a read-only load through them
// that should take the non-coherent path says so (__ldg) instead of leaving the compiler to prove it.
//
//   Proj        w [E, N, ceil(K·b/8)] u8, scales [E, N(, nb)], zp (packed, nullable), bias [E, N] f32 (nullable)
//   Fc1Weights  fc1, fc3 (GATE_FC3 only), E_routed, shared_fc1 [S, ...] (nullable), zp_offset
//   Fc2Weights  fc2, E_routed, shared_fc2 [S, ...] (nullable), zp_offset
//   RouteGroups sorted [R_pad] route ids by expert, offsets [E + 1], tile_offsets [E + 1] (routing/group.cuh)
//   ActParams   alpha, beta, limit, limit_after (epilogue/act.cuh)
//   SelfRoute   route, logits [rows, E_logits], logits_f32, E_logits, k_routed, S, normalize, expert_map
//               (engines/self_route.cuh)
#pragma once

#include "core/types.cuh"

namespace qmoe {

// One projection's expert tensors (routed, or the shared experts' when it is a shared_* member).
template <typename S> struct Proj {
  const u8* w;        // [E, N, ceil(K·b/8)] codes (tiled layout: core/codes.cuh)
  const S* scales;    // [E, N(, nb)] scales, or tiled meta records (core/dequant.cuh)
  const u8* zp;       // packed zero points, or NULL
  const float* bias;  // [E, N] float32, or NULL
};

template <typename S> struct Fc1Weights {
  Proj<S> fc1;         // [E, N1, H·b/8]: N1 = 2I for fused gates, else I
  Proj<S> fc3;         // [E, I, H·b/8]: read only when the gate is FC3
  i32 E_routed;        // expert ids from E_routed on are shared experts (core/experts.cuh)
  Proj<S> shared_fc1;  // [S, N1, H·b/8]: all NULL without shared experts
  float zp_offset;     // the implicit zero point of codes without zero points: 2^(b-1)
};

template <typename S> struct Fc2Weights {
  Proj<S> fc2;         // [E, H, I·b/8]
  i32 E_routed;
  Proj<S> shared_fc2;  // [S, H, I·b/8]
  float zp_offset;
};

// What group_by_expert (routing/group.cuh) writes and the grouped engines read.
struct RouteGroups {
  const i32* sorted;        // [R_pad] route ids (token·k + slot) grouped by expert
  const i32* offsets;       // [E + 1] each expert's first position in sorted
  const i32* tile_offsets;  // [E + 1] each expert's first route tile
};

struct ActParams {
  float alpha;      // swiglu alpha
  float beta;       // swiglu beta
  float limit;      // swiglu limit (+inf: none)
  i32 limit_after;  // swiglu_limit_after_activation
};

// A decode kernel's own routing (engines/self_route.cuh; kernels/route.py routes_in_decode): with `route`, each block
// routes the call's rows from the logits itself, as the routing kernel would, instead of reading its ids.
struct SelfRoute {
  i32 route;              // 1: route here (the routing launch is dropped); 0: read topk_ids / topk_w
  const void* logits;     // [rows, E_logits] float32 (logits_f32) or T: the call's router logits
  i32 logits_f32;         // 1: float32 logits, 0: the activation dtype
  i32 E_logits;           // the whole layer's experts (an expert slice [ext] routes over all of them)
  i32 k_routed;           // top-k; the row's routes are k_routed + S
  i32 S;                  // shared experts [ext]: slots k_routed.. of every row, weight 1
  i32 normalize;          // normalize_routing_weights
  const i32* expert_map;  // [E_logits] local index or -1 (expert slices [ext]), or NULL
};

}  // namespace qmoe
