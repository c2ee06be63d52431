// core/experts.cuh: which tensors an expert id addresses.
//
// Shared experts [ext] run as extra routes: routing writes ids E_routed .. E_routed + S - 1 for them
// (docs/contract.md, "Shared experts"), so an engine kernel that found its expert id e takes the
// shared tensors of that projection and re-indexes e from 0 -- one compare per block (or per K item
// in the SIMT decode FC2), no extra launch. Shared experts have the routed layout and intermediate
// size (the executor refuses anything else on the GPU), so nothing else about the kernel changes.
//
//   routed  Proj: w [E, N, K·b/8] u8, scales [E, N(, nb)], zp (nullable), bias [E, N] f32 (nullable)
//   shared  Proj: the same with S experts (all NULL without shared experts)
#pragma once

#include "core/args.cuh"
#include "core/types.cuh"

namespace qmoe {

// The projection expert e reads: routed below e_routed; else the shared one, with e re-indexed from 0.
template <typename S>
__device__ __forceinline__ Proj<S> expert_proj(i32& e, i32 e_routed, const Proj<S>& routed, const Proj<S>& shared) {
  if (e < e_routed) return routed;
  e -= e_routed;
  return shared;
}

}  // namespace qmoe
