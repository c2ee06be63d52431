// epilogue/fc2.cuh: the FC2 lane store every tensor-core FC2 kernel shares. A lane of an m16 weight tile holds,
// per route, the results of two output rows, n (tile row g) and n + 8 (tile row g + 8); each is stored only where
// it lies within H (a tile's rows past H are computed, never stored).
//
//   value(h)     the result of row n + 8h (h = 0, 1), called only for a row that is stored, so a bias it loads
//                is loaded only there
//   store(i, v)  puts row i's result where the engine keeps its FC2 output (y [R, H] f32 per route, its routing
//                weight applied or not, written or added in; the engine's index: the one thing that differs)
#pragma once

#include "core/types.cuh"

namespace qmoe {

template <class Value, class Store>
__device__ __forceinline__ void fc2_store_lane(i32 n, i32 H, Value value, Store store) {
  if (n < H) store(n, value(0));
  if (n + 8 < H) store(n + 8, value(1));
}

}  // namespace qmoe
