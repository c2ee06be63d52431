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
#include "core/cp_async.cuh"

extern "C" __global__ void __launch_bounds__(P_WG * 128, 1)
wgmma_rate(int chunks, u32 seed, const u8* __restrict__ src, float* __restrict__ out, long long* __restrict__ cycles) {
  extern __shared__ __align__(16) u8 dyn[];
  constexpr int kXBytes = P_N * 256;          // [2 halves][P_N][128 B]
  constexpr int kStage = P_LOAD * 1024 > kXBytes + 4096 ? P_LOAD * 1024 : kXBytes + 4096;
  constexpr int kStages = P_LOAD == 0 ? 1 : (200 * 1024 / kStage < 4 ? 200 * 1024 / kStage : 4);
  static_assert(P_LOAD == 0 || kStages >= 3, "a ring of three stages or more");
  static_assert(P_LOAD * 1024 % (P_WG * 128 * 16) == 0, "whole 16-byte copies per thread");
  u8* smem = wg_smem<kStages * kStage>(dyn);  // + [256][16 B] codes the SYNC variant reads
  u32* sx = reinterpret_cast<u32*>(smem);
  for (int i = threadIdx.x; i < kXBytes / 4; i += blockDim.x) sx[i] = 0x3C003C00u;  // small bf16 values
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
    for (int s = 0; s < 8; ++s) {
      u32(&f)[4] = a[s % (P_INF + 1)];
      if (P_DEQ == 2) {
        D::template fragment<true, 1>(f, w, w2, c, c2, s);
      } else if (P_DEQ) {
        D::template fragment<true, 1>(f, w, w, c, c, s);
      } else {
        f[0] = w[0]; f[1] = w[1]; f[2] = w[2]; f[3] = w[3];
      }
      wgmma_hold(acc);
      wgmma_fence();
      Wgmma<__nv_bfloat16, P_N>::mma(acc, f, smem_desc(xs + stage + (s >> 2) * (P_N * 128) + (s & 3) * 32));
      wgmma_commit();
      wgmma_wait<P_INF>();
      wgmma_hold(acc);
    }
  }
  wgmma_wait<0>();
  wgmma_hold(acc);
  const long long t1 = clock64();
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < P_N / 2; ++i) sum += acc[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}
