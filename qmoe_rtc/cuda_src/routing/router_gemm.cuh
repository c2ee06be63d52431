// routing/router_gemm.cuh: the router GEMM [ext] (docs/contract.md, "Router GEMM"): the layer's own logits.
//
//   x              [rows, H]  T
//   router_weight  [E, H]     WT (float or T)
//   router_bias    [E]        f32, optional
//   router_logits  [rows, E]  f32 (out)    = x · router_weightᵀ + router_bias, float32 accumulation
//
// Three kernels, all deterministic (a fixed summation order for a given launch):
//   router_logits_mma<T, MT, NT, U, KMAX>  WT = T (f16/bf16): tensor cores, mma.sync m16n8k16, f32 accumulate
//   router_logits_gemv<T>                  WT = float, few rows: SIMT, warps split K
//   router_logits_tiled<T>                 WT = float, many rows: SIMT, 64x64 tiles through shared memory
// 16-byte (8-element) loads when H % 8 == 0 and x / router_weight are 16-byte aligned (checked in the
// kernel), element loads otherwise: the same values reach the same FMAs / MMAs either way.
#pragma once

#include "core/mma_pair.cuh"
#include "core/pdl.cuh"
#include "core/reduce.cuh"
#include "core/types.cuh"

namespace qmoe {

inline constexpr int kRgMaxWarps = 16;  // K-split warps of the mma / gemv kernels (blockDim.x = 32·KW)
inline constexpr int kRgTE = 4;         // gemv: experts per block
inline constexpr int kRgRB = 8;         // gemv: rows per block
inline constexpr int kRgTile = 64;      // tiled: experts and rows per block
inline constexpr int kRgTileK = 16;     // tiled: K per shared-memory stage
inline constexpr int kRgTileThreads = 256;

// 8 consecutive T of `row` from k0 as one uint4 (elements past H read as 0). vec: H % 8 == 0 and the
// row is 16-byte aligned, so a chunk is wholly inside or wholly outside.
template <typename T>
__device__ __forceinline__ uint4 rg_chunk(const T* __restrict__ row, i32 k0, i32 H, bool vec) {
  if (vec) return k0 < H ? __ldg(reinterpret_cast<const uint4*>(row + k0)) : make_uint4(0u, 0u, 0u, 0u);
  union { T t[8]; uint4 u; } p;
  p.u = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (k0 + i < H) p.t[i] = row[k0 + i];
  return p.u;
}

// 8 (or 4) consecutive values of `row` from k0 as float32, 0 past H and for a null row.
template <typename T>
__device__ __forceinline__ void rg_load8(const T* __restrict__ row, i32 k0, i32 H, bool vec, float (&v)[8]) {
  if (row != nullptr && vec && k0 < H) {
    load8_f32<T, true>(row + k0, v);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = row != nullptr && k0 + i < H ? Traits<T>::to_float(row[k0 + i]) : 0.0f;
  }
}

template <typename T>
__device__ __forceinline__ void rg_load4(const T* __restrict__ row, i32 k0, i32 H, bool vec, float (&v)[4]) {
  if (row != nullptr && vec && k0 + 4 <= H) {
    if constexpr (Traits<T>::kBytes == 4) {
      const float4 q = *reinterpret_cast<const float4*>(row + k0);
      v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
      union { T t[4]; uint2 u; } p;
      p.u = *reinterpret_cast<const uint2*>(row + k0);
#pragma unroll
      for (int i = 0; i < 4; ++i) v[i] = Traits<T>::to_float(p.t[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = row != nullptr && k0 + i < H ? Traits<T>::to_float(row[k0 + i]) : 0.0f;
  }
}

__device__ __forceinline__ void rg_store(float* __restrict__ out, const float* __restrict__ bias, i32 rows, i32 E,
                                         i32 r, i32 e, float v) {
  if (r < rows && e < E) out[(i64)r * E + e] = bias != nullptr ? v + bias[e] : v;
}

// Tensor cores, router_weight in T. A block computes 16·MT experts × 8·NT rows; its KW = blockDim.x/32
// warps split K in 32-wide steps (warp w takes steps w, w + KW, ..., U steps per round), and warp 0
// adds the others' partial sums in warp order (dynamic shared memory: (KW - 1)·MT·NT·4·32 floats).
// Fragments come straight from global memory: lane (g, t) = (lane / 4, lane % 4) loads the 8 k at
// 8t of a step for expert rows g and g + 8 of each m-tile and for x row g of each n-tile. The step's
// two mmas take words {0, 1} and {2, 3}: mma u's logical k (2t + j, 2t + 8 + j) is the physical
// 8t + 4u + (j, 2 + j) for A and B alike, so the product is the dot product in a permuted k order.
template <typename T, int MT, int NT, int U, int KMAX>
__global__ void __launch_bounds__(32 * KMAX)
router_logits_mma(const T* __restrict__ x, const T* __restrict__ router_weight, const float* __restrict__ router_bias,
                  i32 rows, i32 E_logits, i32 H, float* __restrict__ router_logits) {
  pdl_release();  // routing may launch now: it waits for these logits (core/pdl.cuh)
  extern __shared__ __align__(16) float rg_part[];
  constexpr int kAcc = MT * NT * 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, KW = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const i32 e0 = blockIdx.x * (16 * MT), r0 = blockIdx.y * (8 * NT);
  const bool vec = (H & 7) == 0 && is_aligned(x, 16) && is_aligned(router_weight, 16);
  const T* wrow[MT][2];  // expert rows g, g + 8 of each m-tile (null past E_logits)
  const T* xrow[NT];     // x row g of each n-tile (null past rows)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const i32 e = e0 + mt * 16 + h * 8 + g;
      wrow[mt][h] = e < E_logits ? router_weight + (i64)e * H : nullptr;
    }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const i32 r = r0 + nt * 8 + g;
    xrow[nt] = r < rows ? x + (i64)r * H : nullptr;
  }
  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][nt][c] = 0.0f;

  const i32 steps = (H + 31) / 32;
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (i32 s0 = warp; s0 < steps; s0 += KW * U) {
    uint4 a[U][MT][2], b[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load of the round first
      const i32 s = s0 + u * KW, k0 = s * 32 + 8 * t;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          a[u][mt][h] = s < steps && wrow[mt][h] != nullptr ? rg_chunk<T>(wrow[mt][h], k0, H, vec) : zero;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) b[u][nt] = s < steps && xrow[nt] != nullptr ? rg_chunk<T>(xrow[nt], k0, H, vec) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (s0 + u * KW >= steps) continue;  // warp-uniform
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const u32 lo[4] = {a[u][mt][0].x, a[u][mt][1].x, a[u][mt][0].y, a[u][mt][1].y};  // words 0, 1
        const u32 hi[4] = {a[u][mt][0].z, a[u][mt][1].z, a[u][mt][0].w, a[u][mt][1].w};  // words 2, 3
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          Pair2<T>::mma(acc[mt][nt], lo, b[u][nt].x, b[u][nt].y);
          Pair2<T>::mma(acc[mt][nt], hi, b[u][nt].z, b[u][nt].w);
        }
      }
    }
  }

  if (KW > 1) {  // warps 1..KW-1 park their sums; warp 0 adds them in warp order
    if (warp > 0) {
      float* mine = rg_part + (warp - 1) * kAcc * 32;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) mine[((mt * NT + nt) * 4 + c) * 32 + lane] = acc[mt][nt][c];
    }
    __syncthreads();
    if (warp > 0) return;
    for (int w = 1; w < KW; ++w) {
      const float* theirs = rg_part + (w - 1) * kAcc * 32;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[mt][nt][c] += theirs[((mt * NT + nt) * 4 + c) * 32 + lane];
    }
  }
  // C fragment: c0, c1 at (expert g, rows 2t, 2t + 1), c2, c3 at expert g + 8
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        rg_store(router_logits, router_bias, rows, E_logits, r0 + nt * 8 + 2 * t + (c & 1),
                 e0 + mt * 16 + g + 8 * (c >> 1), acc[mt][nt][c]);
}

// SIMT, router_weight in float32, few rows: a block computes kRgTE experts × kRgRB rows; lane l of
// warp w takes the 8-element chunks w·32 + l, + 32·KW, ... (each weight chunk serves every row), then
// a butterfly over the lanes and warp 0..KW-1 in order.
template <typename T>
__global__ void __launch_bounds__(32 * kRgMaxWarps)
router_logits_gemv(const T* __restrict__ x, const float* __restrict__ router_weight,
                   const float* __restrict__ router_bias, i32 rows, i32 E_logits, i32 H, float* __restrict__ router_logits) {
  pdl_release();  // routing may launch now: it waits for these logits (core/pdl.cuh)
  __shared__ float part[kRgMaxWarps][kRgTE * kRgRB];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, KW = blockDim.x >> 5;
  const i32 e0 = blockIdx.x * kRgTE, r0 = blockIdx.y * kRgRB;
  const bool vec = (H & 7) == 0 && is_aligned(x, 16) && is_aligned(router_weight, 16);
  const float* wrow[kRgTE];
  const T* xrow[kRgRB];
#pragma unroll
  for (int te = 0; te < kRgTE; ++te) wrow[te] = e0 + te < E_logits ? router_weight + (i64)(e0 + te) * H : nullptr;
#pragma unroll
  for (int r = 0; r < kRgRB; ++r) xrow[r] = r0 + r < rows ? x + (i64)(r0 + r) * H : nullptr;
  float acc[kRgTE][kRgRB];
#pragma unroll
  for (int te = 0; te < kRgTE; ++te)
#pragma unroll
    for (int r = 0; r < kRgRB; ++r) acc[te][r] = 0.0f;

  const i32 chunks = (H + 7) / 8;
  for (i32 c = warp * 32 + lane; c < chunks; c += 32 * KW) {
    float w[kRgTE][8];
#pragma unroll
    for (int te = 0; te < kRgTE; ++te) rg_load8<float>(wrow[te], c * 8, H, vec, w[te]);
#pragma unroll
    for (int r = 0; r < kRgRB; ++r) {
      if (xrow[r] == nullptr) continue;  // block-uniform
      float xv[8];
      rg_load8<T>(xrow[r], c * 8, H, vec, xv);
#pragma unroll
      for (int te = 0; te < kRgTE; ++te)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[te][r] = fmaf(w[te][i], xv[i], acc[te][r]);
    }
  }
#pragma unroll
  for (int te = 0; te < kRgTE; ++te)
#pragma unroll
    for (int r = 0; r < kRgRB; ++r) {
      const float v = warp_sum(acc[te][r]);
      if (lane == 0) part[warp][te * kRgRB + r] = v;
    }
  __syncthreads();
  if (threadIdx.x < kRgTE * kRgRB) {
    const int te = threadIdx.x / kRgRB, r = threadIdx.x % kRgRB;
    float s = part[0][threadIdx.x];
    for (int w = 1; w < KW; ++w) s += part[w][threadIdx.x];
    rg_store(router_logits, router_bias, rows, E_logits, r0 + r, e0 + te, s);
  }
}

// SIMT, router_weight in float32, many rows: 64 experts × 64 rows per block, K in stages of 16 through
// shared memory (the next stage's loads in flight during this one's FMAs); thread (tm, tn) owns
// experts 4·tm.. and rows 4·tn.., summed over k in order.
template <typename T>
__global__ void __launch_bounds__(kRgTileThreads)
router_logits_tiled(const T* __restrict__ x, const float* __restrict__ router_weight,
                    const float* __restrict__ router_bias, i32 rows, i32 E_logits, i32 H, float* __restrict__ router_logits) {
  pdl_release();  // routing may launch now: it waits for these logits (core/pdl.cuh)
  __shared__ __align__(16) float ws[kRgTileK][kRgTile + 4];  // [k][expert]
  __shared__ __align__(16) float xs[kRgTileK][kRgTile + 4];  // [k][row]
  const int tid = threadIdx.x, tm = tid & 15, tn = tid >> 4;
  const i32 e0 = blockIdx.x * kRgTile, r0 = blockIdx.y * kRgTile;
  const int lr = tid >> 2, lk = (tid & 3) * 4;  // loader: tile row lr, k offset lk (4 consecutive k)
  const bool vec = (H & 3) == 0 && is_aligned(x, 16) && is_aligned(router_weight, 16);
  const float* wp = e0 + lr < E_logits ? router_weight + (i64)(e0 + lr) * H : nullptr;
  const T* xp = r0 + lr < rows ? x + (i64)(r0 + lr) * H : nullptr;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  float wv[4], xv[4];
  rg_load4<float>(wp, lk, H, vec, wv);
  rg_load4<T>(xp, lk, H, vec, xv);
  for (i32 k0 = 0; k0 < H; k0 += kRgTileK) {
    __syncthreads();  // the previous stage is read
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      ws[lk + i][lr] = wv[i];
      xs[lk + i][lr] = xv[i];
    }
    __syncthreads();
    if (k0 + kRgTileK < H) {
      rg_load4<float>(wp, k0 + kRgTileK + lk, H, vec, wv);
      rg_load4<T>(xp, k0 + kRgTileK + lk, H, vec, xv);
    }
#pragma unroll
    for (int kk = 0; kk < kRgTileK; ++kk) {
      const float4 a = *reinterpret_cast<const float4*>(&ws[kk][tm * 4]);
      const float4 b = *reinterpret_cast<const float4*>(&xs[kk][tn * 4]);
      const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) rg_store(router_logits, router_bias, rows, E_logits, r0 + tn * 4 + j, e0 + tm * 4 + i, acc[i][j]);
}

}  // namespace qmoe
