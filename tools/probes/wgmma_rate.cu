// tools/probes/wgmma_rate.cu: how fast can warpgroup MMAs with A from registers run on one SM, with and
// without the engines' per-step dequantization and per-chunk hand-offs? (tools/wgmma_probe.py)
//
// Every block: P_WG warpgroups, each issuing one m64nNk16 (bf16, A in registers, B = a P_N-route tile in
// shared memory, 128-byte swizzle) per k16 step, 8 steps per 128-code chunk, P_INF MMAs kept in flight.
//   P_DEQ 0: A is fixed registers; 1: A is built per step from a lane's 32 int4 codes with a scale and a
//          zero point (core/mma_pair.cuh, as the prefill engines do); the codes change every chunk. 1
//          gives both of a lane's rows the same codes and coefficients, so the compiler dequantizes once
//          for two rows; 2 gives each row its own (the engines' work: twice 1's).
//   P_SYNC 0: no hand-off; 1: every chunk starts with __syncthreads and a read of the chunk's codes from
//          shared memory (the one-block-per-tile engine's chunk boundary).
//   P_LOAD 0: no copies; L > 0: the chunk's operands come through a ring of shared-memory stages that
//          every thread fills with 16-byte cp.async copies, L KB a chunk (the engine's copy pattern: two
//          chunks ahead, wait, fence, __syncthreads, issue, compute). The first P_N·256 bytes of a stage
//          are the MMA's route tile, the codes the SYNC variant reads follow. Block b copies chunk c from
//          src + ((b / P_SHARE) · 1 MB + c · L KB) mod P_SPAN_MB MB: blocks in a group of P_SHARE read
//          the same bytes at about the same time, as the engine's blocks do for a route tile.
//   P_FP8 1: the MMAs are m64nNk32 on float8 e4m3 (core/wgmma.cuh WgE4m3), 4 k32 steps a chunk, the route
//          tile P_N rows × 128 bytes. P_DEQ then means: 0 fixed registers; 1 and 2 int4 codes (zero point 8)
//          made e4m3 per step in registers (e4m3_of_codes below: exact; 1 the same codes for both rows, 2
//          each row its own); 3 A read as prepacked e4m3 codes, one 16-byte shared-memory load a step.
//   P_PROMOTE 1: each chunk's MMAs accumulate into their own registers (the first step overwrites) and the
//          chunk ends with wgmma_wait<0> and acc += scale · part (P_N/2 FFMAs a thread): what a scale a
//          128-code block costs when it cannot be folded into A (FP8 activations with a scale a group).
// cycles[block] = clock64 across the loop; out = the accumulators' sum (keeps the work alive).
#include "core/mma_pair.cuh"
#include "core/types.cuh"
#include "core/wgmma.cuh"

using namespace qmoe;

#ifndef P_WG
#define P_WG 2
#endif
#ifndef P_N
#define P_N 256
#endif
#ifndef P_INF
#define P_INF 1
#endif
#ifndef P_DEQ
#define P_DEQ 1
#endif
#ifndef P_SYNC
#define P_SYNC 0
#endif
#ifndef P_LOAD
#define P_LOAD 0
#endif
#ifndef P_SHARE
#define P_SHARE 1
#endif
#ifndef P_SPAN_MB
#define P_SPAN_MB 16
#endif
#ifndef P_FP8
#define P_FP8 0
#endif
#ifndef P_PROMOTE
#define P_PROMOTE 0
#endif
#include "core/cp_async.cuh"

// Four int4 codes (bits 0-15 of q, zero point 8) as the e4m3 bytes of q - 8 in [-8, 7], exactly: two byte
// lookups on each code's low three bits (q < 8: -8 .. -1; q >= 8: 0 .. 7) and a byte select on its fourth.
__device__ __forceinline__ u32 e4m3_of_codes(u32 q) {
  const u32 idx = q & 0x7777u;
  const u32 neg = __byte_perm(0xCACCCED0u, 0xB8C0C4C8u, idx);  // -8 -7 -6 -5 | -4 -3 -2 -1
  const u32 pos = __byte_perm(0x44403800u, 0x4E4C4A48u, idx);  //  0  1  2  3 |  4  5  6  7
  return __byte_perm(neg, pos, ((q >> 1) & 0x4444u) | 0x3210u);
}

#if P_FP8
using WgKind = WgE4m3;
constexpr int kSteps = 4;  // k32 steps a 128-code chunk
constexpr int kRowBytes = 128;  // a route's chunk: 128 e4m3 codes
#else
using WgKind = __nv_bfloat16;
constexpr int kSteps = 8;
constexpr int kRowBytes = 256;
#endif
static_assert(!P_FP8 || P_DEQ <= 3, "P_DEQ 0-3 with P_FP8");
static_assert(P_FP8 || P_DEQ <= 2, "P_DEQ 0-2 with bfloat16");

extern "C" __global__ void __launch_bounds__(P_WG * 128, 1)
wgmma_rate(int chunks, u32 seed, const u8* __restrict__ src, float* __restrict__ out, long long* __restrict__ cycles) {
  extern __shared__ __align__(16) u8 dyn[];
  constexpr int kXBytes = P_N * kRowBytes;    // [2 halves (bf16) or 1 (e4m3)][P_N][128 B]
  constexpr int kStage = P_LOAD * 1024 > kXBytes + 4096 ? P_LOAD * 1024 : kXBytes + 4096;
  constexpr int kStages = P_LOAD == 0 ? 1 : (200 * 1024 / kStage < 4 ? 200 * 1024 / kStage : 4);
  static_assert(P_LOAD == 0 || kStages >= 3, "a ring of three stages or more");
  static_assert(P_LOAD * 1024 % (P_WG * 128 * 16) == 0, "whole 16-byte copies per thread");
  u8* smem = wg_smem<kStages * kStage>(dyn);  // + [256][16 B] codes the SYNC variant reads
  u32* sx = reinterpret_cast<u32*>(smem);
  for (int i = threadIdx.x; i < kXBytes / 4; i += blockDim.x) sx[i] = P_FP8 ? 0x30303030u : 0x3C003C00u;  // small
  u32* sc = reinterpret_cast<u32*>(smem + kXBytes);
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) sc[i] = seed * (i + 1);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const u32 xs = (u32)__cvta_generic_to_shared(smem);
  using D = MmaDeq<__nv_bfloat16, 4, ZP_NONE>;
  ScaleZp sz;
  sz.scale = 0.01f;
  sz.zp = 8.0f;
  const Coef c[1] = {D::coef(sz)};
  sz.scale = 0.02f;
  const Coef c2[1] = {D::coef(sz)};
  float acc[P_N / 2];
#pragma unroll
  for (int i = 0; i < P_N / 2; ++i) acc[i] = 0.0f;
#if P_PROMOTE
  float part[P_N / 2];  // one chunk's sums (P_PROMOTE)
#else
  float (&part)[P_N / 2] = acc;
#endif
  u32 w[4] = {seed ^ threadIdx.x, seed * 3u, seed * 5u + threadIdx.x, seed * 7u};
  u32 w2[4] = {seed * 11u, seed ^ (threadIdx.x << 3), seed * 13u, seed * 17u + threadIdx.x};
  u32 a[P_INF + 1][4];
  const u64 span = (u64)P_SPAN_MB << 20, group = (u64)(blockIdx.x / P_SHARE) << 20;
  auto issue = [&](int ch) {
    if (ch < chunks) {
      const u32 dst = xs + (ch % kStages) * kStage;
#pragma unroll
      for (int q = 0; q < P_LOAD * 1024 / (P_WG * 128 * 16); ++q) {
        const u32 o = (q * P_WG * 128 + threadIdx.x) * 16;
        cp_async(dst + o, src + (group + (u64)ch * (P_LOAD * 1024) + o) % span, 16, true);
      }
    }
    cp_async_commit();
  };
  if (P_LOAD) {
    issue(0);
    issue(1);
  }
  const long long t0 = clock64();
  for (int ch = 0; ch < chunks; ++ch) {
    const u32 stage = P_LOAD ? (ch % kStages) * kStage : 0;
    if (P_LOAD) {
      cp_async_wait<1>();
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncthreads();
      issue(ch + 2);
      sc = reinterpret_cast<u32*>(smem + stage + kXBytes);
    }
    if (P_SYNC) {
      if (!P_LOAD) __syncthreads();
      const uint4 v = reinterpret_cast<const uint4*>(sc)[(threadIdx.x + ch) & 255];
      w[0] ^= v.x; w[1] ^= v.y; w[2] ^= v.z; w[3] ^= v.w;
      if (P_DEQ == 2) { w2[0] += v.y; w2[1] += v.z; w2[2] += v.w; w2[3] += v.x; }
    } else {
      w[ch & 3] += 0x01010101u;
      w2[ch & 3] += 0x02020202u;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      u32(&f)[4] = a[s % (P_INF + 1)];
      if (P_FP8 && P_DEQ == 3) {  // prepacked e4m3: the lane's 16 codes of the step from shared memory
        const uint4 v = reinterpret_cast<const uint4*>(sc)[(threadIdx.x + 32 * s + ch) & 255];
        f[0] = v.x; f[1] = v.y; f[2] = v.z; f[3] = v.w;
      } else if (P_FP8 && P_DEQ) {  // rows g and g + 8: 8 int4 codes each (one word), 16 + 16 e4m3 bytes
        const u32 qa = w[s], qb = P_DEQ == 2 ? w2[s] : w[s];
        f[0] = e4m3_of_codes(qa); f[1] = e4m3_of_codes(qb);
        f[2] = e4m3_of_codes(qa >> 16); f[3] = e4m3_of_codes(qb >> 16);
      } else if (P_FP8) {  // fixed registers (P_DEQ 0): the MMA rate alone
        f[0] = seed; f[1] = seed * 3u; f[2] = seed * 5u; f[3] = seed * 7u;
      } else if (P_DEQ == 2) {
        D::template fragment<true, 1>(f, w, w2, c, c2, s);
      } else if (P_DEQ) {
        D::template fragment<true, 1>(f, w, w, c, c, s);
      } else {
        f[0] = w[0]; f[1] = w[1]; f[2] = w[2]; f[3] = w[3];
      }
      wgmma_hold(part);
      wgmma_fence();
      const u32 at = P_FP8 ? s * 32 : (s >> 2) * (P_N * 128) + (s & 3) * 32;
      Wgmma<WgKind, P_N>::mma(part, f, smem_desc(xs + stage + at), P_PROMOTE && s == 0 ? 0 : 1);
      wgmma_commit();
      wgmma_wait<P_INF>();
      wgmma_hold(part);
    }
#if P_PROMOTE
    wgmma_wait<0>();
    wgmma_hold(part);
    const float scale = __int_as_float(0x3C000000 + (ch & 7));  // a block's scale, never folded away
#pragma unroll
    for (int i = 0; i < P_N / 2; ++i) acc[i] = fmaf(scale, part[i], acc[i]);
#endif
  }
  wgmma_wait<0>();
  wgmma_hold(part);
  const long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < P_N / 2; ++i) sum += acc[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
