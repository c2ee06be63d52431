// engines/ring_gate.cuh: what one issue of a decode ring stage copies (RingParts) and the gate a ring's prologue
// may pass between its weight and activation copies (NoGate; engines/mma_ring.cuh mma_rows_ring).
#pragma once

namespace qmoe {

// What a ring stage's copies hold in one issue: the weights (codes, scale / zero-point words), the activations
// (the x ring's), or both.
template <bool W, bool X> struct RingParts {
  static constexpr bool kW = W, kX = X;
};

// The gate of a ring's prologue (mma_rows_ring): with an active gate the first stages' weight copies are issued,
// then gate() runs (block-uniform, it may hold barriers: the decode FC1's route scan, FC2's wait for its expert's
// FC1 tiles), then their activation copies: the weights are on their way while the block waits. gate() false: the
// block has nothing to compute; its copies are drained and the product returns false. NoGate: none.
struct NoGate {
  __device__ __forceinline__ bool operator()() const { return true; }
};
template <class G> struct GateActive {
  static constexpr bool value = true;
};
template <> struct GateActive<NoGate> {
  static constexpr bool value = false;
};

}  // namespace qmoe
