// core/experts.cuh: which tensors an expert id addresses.
//
// Shared experts [ext] run as extra routes: routing writes ids E_routed .. E_routed + S - 1 for them
// (docs/contract.md, "Shared experts"), so an engine kernel that found its expert id e swaps in the
// shared tensors of that projection and re-indexes e from 0 -- one compare per block (or per K item
// in the SIMT decode FC2), no extra launch. Shared experts have the routed layout and intermediate
// size (the executor refuses anything else on the GPU), so nothing else about the kernel changes.
//
//   w  [E, N, K·b/8] u8   routed weights     shared_w  [S, N, K·b/8] u8
//   s  [E, N(, nb)]       routed scales      shared_s  [S, N(, nb)]
//   z  packed zero points (nullable)        shared_z  (nullable)
//   b  [E, N] f32 bias (nullable)            shared_b  [S, N] f32 (nullable)
#pragma once

#include "core/types.cuh"

namespace qmoe {

template <typename X> struct NoDeduce { using type = X; };

// e >= e_routed: e becomes the shared expert's index and w/s/z/b its tensors (the kernel's own
// restrict-qualified parameters are reassigned in place).
template <typename W, typename S, typename Z, typename B>
__device__ __forceinline__ void pick_expert(i32& e, i32 e_routed, W& w, S& s, Z& z, B& b, typename NoDeduce<W>::type sw,
                                            typename NoDeduce<S>::type ss, typename NoDeduce<Z>::type sz,
                                            typename NoDeduce<B>::type sb) {
  if (e < e_routed) return;
  e -= e_routed;
  w = sw;
  s = ss;
  z = sz;
  b = sb;
}

}  // namespace qmoe
