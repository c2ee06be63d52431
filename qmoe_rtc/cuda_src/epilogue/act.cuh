// epilogue/act.cuh: the QMoE activations (docs/contract.md, "What each route computes"), all in float32.
//
//   relu, gelu (tanh form), silu, identity, relu2 = relu(x)^2            -- one input
//   swiglu: G = min(g, limit), L = clamp(l, -limit, limit), G*sigmoid(alpha*G)*(L + beta)
//           (limit_after = 1: min(g*sigmoid(alpha*g), limit) * (L + beta)); a NaN g or l stays NaN
//           (min_keep_nan / clamp_keep_nan), as in the reference
//   geglu:  gelu(g) * l
//   silu/gelu with FC3: act(fc1) * fc3                                     -- gated form
#pragma once

#include "core/args.cuh"
#include "core/types.cuh"

namespace qmoe {

enum Act : int { ACT_RELU = 0, ACT_GELU = 1, ACT_SILU = 2, ACT_IDENTITY = 3, ACT_RELU2 = 4, ACT_SWIGLU = 5, ACT_GEGLU = 6 };

// Where the gate and the linear half of a gated activation come from.
enum Gate : int {
  GATE_NONE = 0,    // act(fc1 row i)
  GATE_FUSED1 = 1,  // fc1 rows interleaved [g0, l0, g1, l1, ...]: gate 2i, linear 2i+1
  GATE_FUSED2 = 2,  // fc1 rows [g | l]: gate i, linear I + i
  GATE_FC3 = 3,     // gate fc1 row i, linear fc3 row i
};

// 1 / (1 + e^-x) on the special-function unit: ex2.approx and rcp.approx (a few ulp of float32, far below
// the contract's tolerance and any 16-bit output's rounding; x -> ±inf still gives 0 / 1, NaN stays NaN).
// The IEEE expf and division cost the FC1 epilogues ~40 instructions a value.
__device__ __forceinline__ float sigmoidf_(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// min(x, hi) and clamp(x, lo, hi) that keep a NaN x, as the reference's np.minimum / np.clip do (fminf / fmaxf
// return the other operand, so a NaN became +-limit): PTX min.NaN / max.NaN (sm_80+: NaN when either operand
// is; FMNMX.NAN, one instruction as fminf's FMNMX). The swiglu limit is never NaN (a positive number or +inf).
__device__ __forceinline__ float min_keep_nan(float x, float hi) {
  float r = 0.0f;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(hi));
  return r;
}
__device__ __forceinline__ float max_keep_nan(float x, float lo) {
  float r = 0.0f;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(lo));
  return r;
}
__device__ __forceinline__ float clamp_keep_nan(float x, float lo, float hi) {
  return min_keep_nan(max_keep_nan(x, lo), hi);
}

__device__ __forceinline__ float gelu_tanh(float x) {
  const float c = 0.7978845608028654f;  // sqrt(2/pi)
  return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

template <int ACT> __device__ __forceinline__ float act1(float x) {
  if constexpr (ACT == ACT_RELU) return max_keep_nan(x, 0.0f);  // NaN stays NaN, as np.maximum
  else if constexpr (ACT == ACT_GELU) return gelu_tanh(x);
  else if constexpr (ACT == ACT_SILU) return x * sigmoidf_(x);
  else if constexpr (ACT == ACT_IDENTITY) return x;
  else if constexpr (ACT == ACT_RELU2) { const float r = max_keep_nan(x, 0.0f); return r * r; }
  else return x;  // GLU kinds are handled by act_gated
}

// Activation of a gated pair (g from the gate row, l from the linear row).
template <int ACT> __device__ __forceinline__ float act_gated(float g, float l, const ActParams& p) {
  if constexpr (ACT == ACT_SWIGLU) {
    const float L = clamp_keep_nan(l, -p.limit, p.limit);
    if (p.limit_after) return min_keep_nan(g * sigmoidf_(p.alpha * g), p.limit) * (L + p.beta);
    const float G = min_keep_nan(g, p.limit);
    return G * sigmoidf_(p.alpha * G) * (L + p.beta);
  } else if constexpr (ACT == ACT_GEGLU) {
    return gelu_tanh(g) * l;
  } else {
    return act1<ACT>(g) * l;  // silu / gelu with FC3
  }
}

}  // namespace qmoe
