// moe_mma.cuh: the tensor-core decode path (float16 / bfloat16 activations, 1/2/4/8-bit weights).
//
// Expert-grouped: a block belongs to (row tile, route r); it works only if r is the first route of
// its expert e = ids[r] and then serves every route of e (found by scanning the R route ids in the
// block), so each expert's weights are read once however many tokens chose it. Blocks of the other
// routes of e exit at once. No grouping pass, no extra launch.
//
//   x        [rows, H]         T     input rows (route r reads row r / k)
//   ids, wts [R]               i32, f32   routes (route_topk), R = rows·k <= kMmaMaxRoutes
//   W1       [E, N1, H·b/8]    u8    N1 = F·I (+ scales [E, N1(, H/blk)], zero points, bias [E, N1] f32)
//   W3       [E, I, H·b/8]     u8    GATE_FC3 only, same bit width as W1
//   act      [R, I]            T     fc1_mma out (activation rounded to T), fc2_mma_combine in
//   W2       [E, H, I·b/8]     u8
//   y        [R, H]            f32   wts[r]·(act[r]·W2[e]ᵀ + b2[e]) of every route
//   counters [ceil(H/rows per block)] u32, zero between calls: blocks done per H tile
//   out      [rows, H]         T     Σ_slot y[row·k + slot] in slot order, rounded once (last block of a tile)
//
// Warp tile = one mma.sync m16n8k16 (f32 accumulate): A = 16 weight rows × 16 codes dequantized
// exactly in registers, B = 16 activations × 8 routes, C = 16 rows × 8 routes. K is walked in
// chunks of 128 codes; lane (g, t) = (lane / 4, lane % 4) loads 32 consecutive codes of rows g and
// g + 8 (one 16-byte load per row for 4-bit) and the matching 32 activations of route g. The mma's
// k index is mapped onto those codes in the order the dequantization produces them (pairs of codes
// 16/b apart), and the activations are permuted the same way, so no shuffle is needed.
// Dequantization: (magic | q) − (magic + zp) is exact in f16 (magic 1024) and bf16 (magic 128, q < 128);
// bf16 with 8-bit codes goes through float32 ((2^23 | q) − (2^23 + zp)), rounded once (exact: |q − zp| ≤ 255).
// Scales: block size ≥ 128 or row-wise — one scale per row over a 128-code chunk — the mma sums the
// exact (q − zp)·x in float32 and the row scale multiplies that partial sum; smaller blocks — each
// pair is multiplied by its scale in T first (rounded once, like any dequantize-to-T engine).
//
// Weights, scales and zero points stream through a per-warp cp.async ring in dynamic shared memory
// (kMmaStages stages of 2 KiB of codes); each lane reads back only what it copied (no barrier).
// A block = 4 warps = MT row tiles × KS slices of K (MT·KS = 4, KS a launch argument); the KS
// partial sums are added in a fixed order (deterministic). A route group of 8·NG routes shares the
// dequantized A fragments; experts with more routes take several passes.
// Not covered (the executor uses the SIMT gemv kernels and logs why): float32 activations, 3-bit
// codes, zero_point_offset, FC3 with a bit width other than FC1's, 1-bit with block 16, K % 32 ≠ 0.
#pragma once

#include "dequant.cuh"
#include "moe_act.cuh"
#include "types.cuh"

namespace qmoe {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaMaxRoutes = 512;  // route ids a block scans (R = rows·k)
constexpr int kMmaChunk = 128;      // codes of K per warp step (4 lanes × 32)
constexpr int kMmaPrefetchRoutes = 64;  // up to this many routes, blocks warm L2 before the route scan
constexpr int kMmaPrefetchChunks = 4;   // chunks of the lane rows warmed per warp

// Two values of T in one u32: exact integer codes, scale multiply, mma.
template <typename T> struct Pair2;

template <> struct Pair2<__half> {
  static constexpr u32 kMagic = 0x64006400u;  // half2(1024, 1024): (magic | q) = 1024 + q, q < 1024
  static constexpr float kMagicF = 1024.0f;
  static constexpr u32 kMagicByte = 0x64646464u;
  static __device__ __forceinline__ u32 splat(float v) {
    const __half2 h = __float2half2_rn(v);
    return *reinterpret_cast<const u32*>(&h);
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
  }
  static __device__ __forceinline__ u32 sub(u32 a, u32 zpm) {
    u32 d;
    asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(zpm));
    return d;
  }
  static __device__ __forceinline__ u32 fma(u32 a, u32 b, u32 c) {  // a * b + c
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  static __device__ __forceinline__ u32 mul(u32 a, u32 b) {
    u32 d;
    asm("mul.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  static __device__ __forceinline__ u32 sub_mul(u32 a, u32 zpm, u32 sc) {  // (a - zpm) * sc
    u32 d;
    asm("sub.f16x2 %0, %1, %2;\n\tmul.f16x2 %0, %0, %3;" : "=&r"(d) : "r"(a), "r"(zpm), "r"(sc));
    return d;
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <> struct Pair2<__nv_bfloat16> {
  static constexpr u32 kMagic = 0x43004300u;  // bf16x2(128, 128): (magic | q) = 128 + q, q < 128
  static constexpr float kMagicF = 128.0f;
  static constexpr u32 kMagicByte = 0;  // 8-bit codes go through float32
  static __device__ __forceinline__ u32 splat(float v) {
    const __nv_bfloat162 h = __float2bfloat162_rn(v);
    return *reinterpret_cast<const u32*>(&h);
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const u32*>(&h);
  }
  static __device__ __forceinline__ u32 sub(u32 a, u32 zpm) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %3, %2;" : "=r"(d) : "r"(a), "r"(zpm ^ 0x80008000u), "r"(0x3F803F80u));
    return d;
  }
  static __device__ __forceinline__ u32 sub_mul(u32 a, u32 zpm, u32 sc) {  // fma forms exist on sm_80
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %4, %2;\n\tfma.rn.bf16x2 %0, %0, %3, %5;"
        : "=&r"(d) : "r"(a), "r"(zpm ^ 0x80008000u), "r"(sc), "r"(0x3F803F80u), "r"(0x80008000u));
    return d;
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Dequantization coefficients of one row over one lane's 32 codes (two when BLOCK == 16).
struct Coef {
  u32 zpm;  // T2 splat of magic + zp   (float32 path: unused)
  u32 zph;  // float16 4-bit: splat of -(magic/16 + zp), the addend for codes read as 16·q
  u32 sc;   // T2 splat of scale
  float zpf;  // float32 path: 2^23 + zp
  float scf;  // scale
};

template <typename T, int B> struct MmaDeq {
  static constexpr bool kF32 = B == 8 && Pair2<T>::kMagicByte == 0;  // bf16 with 8-bit codes
  static constexpr int kPairsPerWord = 16 / B;                         // pair i = codes (c, c + 16/B)
  static constexpr int kCodesPerWord = 32 / B;

  static __device__ __forceinline__ Coef coef(ScaleZp s) {
    Coef c;
    if constexpr (kF32) {
      c.zpf = 8388608.0f + s.zp;
      c.scf = s.scale;
      c.zpm = c.zph = c.sc = 0;
    } else {
      c.zpm = Pair2<T>::splat(Pair2<T>::kMagicF + s.zp);
      c.zph = Pair2<T>::splat(-(Pair2<T>::kMagicF / 16.0f + s.zp));
      c.sc = Pair2<T>::splat(s.scale);
      c.zpf = 0.0f;
      c.scf = s.scale;  // applied to the mma's partial sums when the scale is constant over a chunk
    }
    return c;
  }
  static __device__ __forceinline__ Coef zero() {
    Coef c;
    c.zpm = kF32 ? 0u : Pair2<T>::kMagic;
    c.zph = kF32 ? 0u : Pair2<T>::splat(-Pair2<T>::kMagicF / 16.0f);  // (magic | 0)/16 + zph = 0
    c.sc = 0u;
    c.zpf = 8388608.0f;
    c.scf = 0.0f;
    return c;
  }
  // First code of pair i within the lane's 32 codes (the second is 16/B further).
  static __device__ __forceinline__ constexpr int first_code(int i) {
    return (i / kPairsPerWord) * kCodesPerWord + i % kPairsPerWord;
  }
  // Pair i (0..15) of the lane's 32 codes as T2 for codes (c, c + 16/B): (q - zp) * scale, or the
  // exact (q - zp) when !SCALED (the caller scales the mma's partial sums).
  template <bool SCALED>
  static __device__ __forceinline__ u32 pair(const u32 (&w)[B], int i, const Coef& cf) {
    const int word = i / kPairsPerWord, j = i % kPairsPerWord;
    if constexpr (kF32) {
      const float lo = __int_as_float(__byte_perm(w[word], 0x4B000000u, 0x7440 + j)) - cf.zpf;
      const float hi = __int_as_float(__byte_perm(w[word], 0x4B000000u, 0x7442 + j)) - cf.zpf;
      return SCALED ? Pair2<T>::pack(lo * cf.scf, hi * cf.scf) : Pair2<T>::pack(lo, hi);
    } else if constexpr (B == 4 && Pair2<T>::kMagicByte != 0) {
      // float16, 4-bit: pairs 0/2 of a word are (magic | q) at nibbles 0 and 2 of each half; pairs 1/3
      // are read in place as (magic | 16·q) and brought to q - zp by one exact fma (x/16 - (64 + zp)):
      // one shift per word instead of three
      const u32 wv = j >= 2 ? w[word] >> 8 : w[word];
      if (j & 1) {
        const u32 v = (wv & 0x00f000f0u) | Pair2<T>::kMagic;
        const u32 d = Pair2<T>::fma(v, 0x2C002C00u, cf.zph);  // 0x2C00 = 1/16
        return SCALED ? Pair2<T>::mul(d, cf.sc) : d;
      }
      const u32 v = (wv & 0x000f000fu) | Pair2<T>::kMagic;
      return SCALED ? Pair2<T>::sub_mul(v, cf.zpm, cf.sc) : Pair2<T>::sub(v, cf.zpm);
    } else {
      u32 v;
      if constexpr (B == 8) v = __byte_perm(w[word], Pair2<T>::kMagicByte, 0x4240 + 0x101 * j);
      else v = ((w[word] >> (B * j)) & (((1u << B) - 1u) * 0x00010001u)) | Pair2<T>::kMagic;
      return SCALED ? Pair2<T>::sub_mul(v, cf.zpm, cf.sc) : Pair2<T>::sub(v, cf.zpm);
    }
  }
  // The activations of pair i: (x[c], x[c + 16/B]) from the lane's 32 activations xw (16 words).
  static __device__ __forceinline__ u32 x_pair(const u32 (&xw)[16], int i) {
    const int c1 = first_code(i), c2 = c1 + kPairsPerWord;
    const u32 lo = (c1 & 1) * 2, hi = 4 + (c2 & 1) * 2;
    return __byte_perm(xw[c1 >> 1], xw[c2 >> 1], lo | ((lo + 1) << 4) | (hi << 8) | ((hi + 1) << 12));
  }
};

// The routes of one expert. Every block loads the R ids into shared memory; the block of route r
// proceeds only if no earlier route has the same expert, and then lists (in route order) every
// route of that expert.
struct ExpertRoutes {
  i32 e;     // expert of route blockIdx.y
  i32 n;     // routes listed (0: this block is a duplicate and has nothing to do)
};

__device__ __forceinline__ ExpertRoutes collect_routes(const i32* __restrict__ ids, i32 R, i32* s_ids, i32* s_list,
                                                       i32* s_n) {
  const i32 r = blockIdx.y;
  for (i32 q = threadIdx.x; q < R; q += kMmaThreads) s_ids[q] = ids[q];
  __syncthreads();
  const i32 e = s_ids[r];
  bool dup = false;
  for (i32 q = threadIdx.x; q < r; q += kMmaThreads) dup |= s_ids[q] == e;
  if (__syncthreads_or(dup)) return ExpertRoutes{e, 0};
  if (threadIdx.x < 32) {
    const u32 lane = threadIdx.x;
    i32 n = 0;
    for (i32 base = r; base < R; base += 32) {
      const i32 q = base + (i32)lane;
      const bool hit = q < R && s_ids[q] == e;
      const u32 m = __ballot_sync(0xffffffffu, hit);
      if (hit) s_list[n + __popc(m & ((1u << lane) - 1u))] = q;
      n += __popc(m);
    }
    if (lane == 0) *s_n = n;
  }
  __syncthreads();
  return ExpertRoutes{e, *s_n};
}

// Pipeline stages per warp (cp.async ring in dynamic shared memory).
#ifndef QMOE_MMA_STAGES
#define QMOE_MMA_STAGES 3
#endif
constexpr int kMmaStages = QMOE_MMA_STAGES;
// Blocks per SM the register budget is set for (route groups need more accumulators).
template <int NG> constexpr int mma_min_blocks() { return NG == 1 ? 5 : (NG == 2 ? 4 : 3); }

// One stage of a warp's ring: KST chunks of its two lane rows, as copied (not decoded).
//   codes [KST][2 rows][32 lanes][4·B bytes]       (KST = 8/B: 2 KiB of codes per stage, any B)
//   meta  [KST][2 rows][kWords][32 lanes] u32      the aligned words holding the lane's scale(s)
//                                                  and zero-point byte (decoded at compute time)
// Scale / zp words are the 4-byte-aligned words containing the element: they may reach up to 3
// bytes past a tensor's last element, inside the same allocation granule (CuPy / torch allocate in
// 512-byte units); those bytes are never used.
template <int B, typename ScaleT, int BLOCK, bool ZPW> struct MmaStage {
  static constexpr int KST = B >= 8 ? 1 : 8 / B;
  static constexpr int NSB = BLOCK == 16 ? 2 : 1;                        // scale blocks per lane chunk
  static constexpr int kSW = (NSB == 2 && sizeof(ScaleT) == 4) ? 2 : 1;  // scale words
  static constexpr int kWords = kSW + (ZPW ? 1 : 0);
  static constexpr int kCodeBytes = 4 * B;  // per lane, row, chunk
  static constexpr int kCodes = KST * 2 * 32 * kCodeBytes;
  static constexpr int kBytes = kCodes + KST * 2 * kWords * 32 * 4;
};

__device__ __forceinline__ void cp_async(u32 dst, const void* src, int bytes, bool valid) {
  const int n = valid ? bytes : 0;  // 0: zero-fill, nothing read
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(n));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Warms L2 with the first `chunks` chunks of the lane's two rows (no registers held): issued before
// the route scan so the weights are on their way while the block finds its routes.
template <int B> __device__ __forceinline__ void prefetch_rows(const u8* pa, const u8* pb, i32 K, i32 ks, i32 KS,
                                                               i32 chunks) {
  const i32 t = threadIdx.x & 3, nch = (K + kMmaChunk - 1) / kMmaChunk;
  for (i32 i = 0, c = ks; i < chunks && c < nch; ++i, c += KS) {
    const i32 k0 = c * kMmaChunk + 32 * t;
    if (k0 >= K) break;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(pa + (i64)(k0 / 32) * (4 * B)));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(pb + (i64)(k0 / 32) * (4 * B)));
  }
}

// The launch must give kMmaWarps rings of kMmaStages stages (the host computes the same size:
// kernels/mma.py ring_bytes); a smaller dynamic shared memory is a host bug: trap, never overrun.
template <class Stage> __device__ __forceinline__ void check_ring_size() {
  u32 have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < (u32)(kMmaWarps * kMmaStages * Stage::kBytes)) __trap();
}

// One warp's product over its K slice (chunks ks, ks + KS, ...): acc[ng] (C fragments) +=
// W[rows na, nb] · x[routes]ᵀ. pa, pb: the lane rows' packed codes (K·B/8 bytes each); qa, qb their
// quant params; xrow[ng]: the activation row of route group ng's lane route, or null.
// Weights, scales and zero points stream through a kMmaStages-deep cp.async ring per warp; each lane
// reads back only what it copied, so no barrier is needed.
template <typename T, int B, int NG, class QA, class QB, typename XT>
__device__ __forceinline__ void mma_rows(const QA& qa, const u8* __restrict__ pa, i32 na, const QB& qb,
                                         const u8* __restrict__ pb, i32 nb, i32 e, const XT* const (&xrow)[NG],
                                         i32 K, i32 ks, i32 KS, float (&acc)[NG][4], u8* ring) {
  using ScaleT = typename QA::Scale;
  constexpr bool kZpw = QA::kZp == ZP_PACKED || QB::kZp == ZP_PACKED;  // = the kernel's Stage
  using St = MmaStage<B, ScaleT, QA::kBlock, kZpw>;
  using D = MmaDeq<T, B>;
  constexpr int KST = St::KST, NSB = St::NSB, CB = St::kCodeBytes;
  const i32 lane = threadIdx.x & 31, t = lane & 3;
  const i32 nch = (K + kMmaChunk - 1) / kMmaChunk;
  const i32 step = KS * KST;  // chunks a warp advances per stage
  const u32 ring0 = (u32)__cvta_generic_to_shared(ring);

  // kFactor: one scale per row over a whole chunk (block >= 128 or row-wise): the mma sums the exact
  // (q - zp)·x of a chunk in float32 and the row scale multiplies that partial sum (fewer
  // instructions, and the products are never rounded to T). Else each pair is scaled in T.
  constexpr bool kFactor = QA::kBlock == 0 || QA::kBlock >= kMmaChunk;
  const i32 nblk = QA::kBlock ? K / QA::kBlock : 1;
  const i64 sbase[2] = {((i64)e * qa.N + na) * nblk, ((i64)e * qb.N + nb) * nblk};  // scale index of block 0
  const ScaleT* const sp[2] = {qa.scales, qb.scales};

  auto issue = [&](i32 slot, i32 c0) {
    const u32 base = ring0 + slot * St::kBytes;
#pragma unroll
    for (int u = 0; u < KST; ++u) {
      const i32 c = c0 + u * KS, k0 = c * kMmaChunk + 32 * t;
      if (c >= nch) break;  // warp-uniform
      const bool live = k0 < K;
      const i64 off = live ? (i64)(k0 / 32) * CB : 0;
      // the block of the lane's codes; with kFactor the block of the chunk (the same for every lane,
      // and valid on lanes past K, whose C fragments still need their rows' scale)
      const i32 j = kFactor ? QA::block_of((i64)c * kMmaChunk) : (live ? QA::block_of(k0) : 0);
      const bool mlive = kFactor || live;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const u8* src = (r ? pb : pa) + off;
        const u32 dst = base + ((u * 2 + r) * 32 + lane) * CB;
#pragma unroll
        for (int q = 0; q < (CB + 15) / 16; ++q) cp_async(dst + 16 * q, src + 16 * q, CB < 16 ? CB : 16, live);
        const u32 meta = base + St::kCodes + ((u * 2 + r) * St::kWords) * 128 + lane * 4;
        const i64 si = sbase[r] + j;
        if constexpr (sizeof(ScaleT) == 4) {
#pragma unroll
          for (int w = 0; w < St::kSW; ++w) cp_async(meta + w * 128, sp[r] + si + w, 4, mlive);
        } else {
          cp_async(meta, sp[r] + (si & ~1ll), 4, mlive);
        }
        if constexpr (kZpw) {
          const bool packed = r ? QB::kZp == ZP_PACKED : QA::kZp == ZP_PACKED;
          const i64 zb = packed ? (r ? qb.zp_byte(e, nb, j) : qa.zp_byte(e, na, j)) : 0;
          const u8* zsrc = packed ? (r ? qb.zp : qa.zp) + (zb & ~3ll) : pa;
          cp_async(meta + St::kSW * 128, zsrc, 4, mlive && packed);
        }
      }
    }
  };

  // Coefficients of row r (0: na, 1: nb) for scale block h of chunk u, from the stage's meta words.
  auto coef = [&](const u8* st, int u, int r, int h, i32 j0) -> Coef {
    const i32 j = j0 + h;
    const u32* meta = reinterpret_cast<const u32*>(st + St::kCodes) + ((u * 2 + r) * St::kWords) * 32 + lane;
    ScaleZp sz;
    if constexpr (sizeof(ScaleT) == 4) {
      sz.scale = __uint_as_float(meta[(St::kSW == 2 ? h : 0) * 32]);
    } else {
      const u16 bits = (u16)(meta[0] >> (16 * ((sbase[r] + j) & 1)));
      ScaleT v;
      *reinterpret_cast<u16*>(&v) = bits;
      sz.scale = Traits<ScaleT>::to_float(v);
    }
    const bool packed = r ? QB::kZp == ZP_PACKED : QA::kZp == ZP_PACKED;
    if (packed) {
      const i64 zb = r ? qb.zp_byte(e, nb, j) : qa.zp_byte(e, na, j);
      const u32 byte = (meta[St::kSW * 32] >> (8 * (zb & 3))) & 0xffu;
      sz.zp = r ? QB::zp_from_byte(byte, nb, j) : QA::zp_from_byte(byte, na, j);
    } else {
      sz.zp = (r ? QB::kZp : QA::kZp) == ZP_NONE ? (float)(1u << (B - 1)) : (r ? qb.zp_offset : qa.zp_offset);
    }
    return D::coef(sz);
  };

  auto compute = [&](i32 slot, i32 c0) {
    const u8* st = ring + slot * St::kBytes;
#pragma unroll
    for (int u = 0; u < KST; ++u) {
      const i32 c = c0 + u * KS, k0 = c * kMmaChunk + 32 * t;
      if (c >= nch) break;  // warp-uniform
      const bool live = k0 < K;  // lanes past K (K % 128 != 0) hold zero-filled codes
      u32 ra[B], rb[B];
#pragma unroll
      for (int q = 0; q < (CB + 15) / 16; ++q) {
        const u8* pa_s = st + ((u * 2 + 0) * 32 + lane) * CB + 16 * q;
        const u8* pb_s = st + ((u * 2 + 1) * 32 + lane) * CB + 16 * q;
        if constexpr (CB >= 16) {
          const uint4 va = *reinterpret_cast<const uint4*>(pa_s), vb = *reinterpret_cast<const uint4*>(pb_s);
          ra[4 * q] = va.x; ra[4 * q + 1] = va.y; ra[4 * q + 2] = va.z; ra[4 * q + 3] = va.w;
          rb[4 * q] = vb.x; rb[4 * q + 1] = vb.y; rb[4 * q + 2] = vb.z; rb[4 * q + 3] = vb.w;
        } else if constexpr (CB == 8) {
          const uint2 va = *reinterpret_cast<const uint2*>(pa_s), vb = *reinterpret_cast<const uint2*>(pb_s);
          ra[0] = va.x; ra[1] = va.y; rb[0] = vb.x; rb[1] = vb.y;
        } else {
          ra[0] = *reinterpret_cast<const u32*>(pa_s); rb[0] = *reinterpret_cast<const u32*>(pb_s);
        }
      }
      const i32 j0 = kFactor ? QA::block_of((i64)c * kMmaChunk) : QA::block_of(k0);
      Coef ca[NSB], cb[NSB];
#pragma unroll
      for (int h = 0; h < NSB; ++h) {
        ca[h] = (kFactor || live) ? coef(st, u, 0, h, j0) : D::zero();
        cb[h] = (kFactor || live) ? coef(st, u, 1, h, j0) : D::zero();
      }
      u32 a[8][4];
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int h0 = NSB == 2 ? D::first_code(2 * s) / 16 : 0, h1 = NSB == 2 ? D::first_code(2 * s + 1) / 16 : 0;
        a[s][0] = D::template pair<!kFactor>(ra, 2 * s, ca[h0]);
        a[s][1] = D::template pair<!kFactor>(rb, 2 * s, cb[h0]);
        a[s][2] = D::template pair<!kFactor>(ra, 2 * s + 1, ca[h1]);
        a[s][3] = D::template pair<!kFactor>(rb, 2 * s + 1, cb[h1]);
      }
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        u32 xw[16];
        if (xrow[g] != nullptr && live) {
          const uint4* px = reinterpret_cast<const uint4*>(xrow[g] + k0);
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const uint4 q = __ldg(px + v);
            xw[4 * v] = q.x; xw[4 * v + 1] = q.y; xw[4 * v + 2] = q.z; xw[4 * v + 3] = q.w;
          }
        } else {
#pragma unroll
          for (int v = 0; v < 16; ++v) xw[v] = 0u;
        }
        if constexpr (kFactor) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int s = 0; s < 8; ++s) Pair2<T>::mma(part, a[s], D::x_pair(xw, 2 * s), D::x_pair(xw, 2 * s + 1));
          acc[g][0] = fmaf(ca[0].scf, part[0], acc[g][0]);  // C rows g (lane row na) ...
          acc[g][1] = fmaf(ca[0].scf, part[1], acc[g][1]);
          acc[g][2] = fmaf(cb[0].scf, part[2], acc[g][2]);  // ... and g + 8 (lane row nb)
          acc[g][3] = fmaf(cb[0].scf, part[3], acc[g][3]);
        } else {
#pragma unroll
          for (int s = 0; s < 8; ++s) Pair2<T>::mma(acc[g], a[s], D::x_pair(xw, 2 * s), D::x_pair(xw, 2 * s + 1));
        }
      }
    }
  };

  // ring: stage i lives in slot i % S; S - 1 stages in flight while one is computed
  constexpr int S = kMmaStages;
#pragma unroll
  for (int i = 0; i < S - 1; ++i) {
    if (ks + i * step < nch) issue(i, ks + i * step);
    cp_async_commit();  // empty groups keep the count uniform
  }
  for (i32 i = 0, c = ks; c < nch; ++i, c += step) {
    cp_async_wait<S - 2>();  // stage i has landed (this lane's copies)
    const i32 cn = c + (S - 1) * step;
    if (cn < nch) issue((i + S - 1) % S, cn);  // the slot computed in iteration i - 1
    cp_async_commit();
    compute(i % S, c);
  }
  cp_async_wait<0>();
}

// Adds the KS slices' C fragments into the slice-0 warps (fixed order). red: kMmaWarps·NG·4·32 floats.
template <int NG> __device__ __forceinline__ void reduce_slices(float (&acc)[NG][4], i32 mt, i32 ks, i32 MT, i32 KS,
                                                                float* red) {
  if (KS == 1) return;
  const i32 lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  if (ks > 0) {
#pragma unroll
    for (int g = 0; g < NG; ++g)
#pragma unroll
      for (int v = 0; v < 4; ++v) red[((w * NG + g) * 4 + v) * 32 + lane] = acc[g][v];
  }
  __syncthreads();
  if (ks == 0) {
    for (i32 s = 1; s < KS; ++s) {
      const i32 ws = s * MT + mt;
#pragma unroll
      for (int g = 0; g < NG; ++g)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[g][v] += red[((ws * NG + g) * 4 + v) * 32 + lane];
    }
  }
  __syncthreads();
}

// Rows per 16-row warp tile: gated FC1 = 8 outputs (rows g: gate, g + 8: linear); else 16 outputs.
template <int GATE, typename T, typename ScaleT, int B1, int Z1, int Z3, int BLOCK, int ACT, int NG>
__global__ void __launch_bounds__(kMmaThreads, mma_min_blocks<NG>())
fc1_mma(const T* __restrict__ x, const i32* __restrict__ ids, i32 R, i32 k, i32 H, i32 I, i32 KS,
        const u8* __restrict__ w1, const ScaleT* __restrict__ s1, const u8* __restrict__ z1, const float* __restrict__ b1,
        const u8* __restrict__ w3, const ScaleT* __restrict__ s3, const u8* __restrict__ z3, const float* __restrict__ b3,
        float zp_offset, float alpha, float beta, float limit, i32 limit_after, T* __restrict__ act) {
  __shared__ i32 s_ids[kMmaMaxRoutes], s_list[kMmaMaxRoutes], s_n;
  __shared__ float red[kMmaWarps * NG * 4 * 32];
  extern __shared__ __align__(16) u8 dyn_smem[];
  using Stage = MmaStage<B1, ScaleT, BLOCK, Z1 == ZP_PACKED || (GATE == GATE_FC3 && Z3 == ZP_PACKED)>;
  check_ring_size<Stage>();
  constexpr bool kGated = GATE != GATE_NONE;
  constexpr bool kFused = GATE == GATE_FUSED1 || GATE == GATE_FUSED2;
  constexpr int kOutPerTile = kGated ? 8 : 16;
  const ActParams ap{alpha, beta, limit, limit_after};
  const i32 e = ids[blockIdx.y];
  const i32 N1 = kFused ? 2 * I : I;
  const QuantParams<ScaleT, B1, BLOCK, Z1> q1{s1, z1, zp_offset, N1, H};
  const QuantParams<ScaleT, B1, BLOCK, Z3> q3{s3, z3, zp_offset, I, H};
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i32 MT = kMmaWarps / KS, mt = warp % MT, ks = warp / MT;
  const i32 g = lane >> 2, t = lane & 3;
  const i32 o0 = (blockIdx.x * MT + mt) * kOutPerTile;
  // lane rows: gated: gate and linear row of output o0 + g; plain: outputs o0 + g, o0 + g + 8 (clamped:
  // computed, never stored)
  const i32 oa = min(o0 + g, I - 1), ob = kGated ? oa : min(o0 + g + 8, I - 1);
  i32 na, nb;
  if constexpr (GATE == GATE_FUSED1) { na = 2 * oa; nb = 2 * oa + 1; }
  else if constexpr (GATE == GATE_FUSED2) { na = oa; nb = I + oa; }
  else { na = oa; nb = ob; }
  const i64 row_bytes = packed_bytes<B1>(H);
  const u8* pa = w1 + ((i64)e * N1 + na) * row_bytes;
  const u8* pb = GATE == GATE_FC3 ? w3 + ((i64)e * I + nb) * row_bytes : w1 + ((i64)e * N1 + nb) * row_bytes;
  if (R <= kMmaPrefetchRoutes) prefetch_rows<B1>(pa, pb, H, ks, KS, kMmaPrefetchChunks);
  const ExpertRoutes er = collect_routes(ids, R, s_ids, s_list, &s_n);
  if (er.n == 0) return;

  for (i32 p = 0; p < er.n; p += 8 * NG) {
    const T* xrow[NG];
#pragma unroll
    for (int gg = 0; gg < NG; ++gg) {
      const i32 j = p + 8 * gg + g;
      xrow[gg] = j < er.n ? x + (i64)(s_list[j] / k) * H : nullptr;
    }
    float acc[NG][4] = {};
    u8* ring = dyn_smem + warp * kMmaStages * Stage::kBytes;
    if constexpr (GATE == GATE_FC3) mma_rows<T, B1, NG>(q1, pa, na, q3, pb, nb, e, xrow, H, ks, KS, acc, ring);
    else mma_rows<T, B1, NG>(q1, pa, na, q1, pb, nb, e, xrow, H, ks, KS, acc, ring);  // both rows from W1
    reduce_slices<NG>(acc, mt, ks, MT, KS, red);
    if (ks == 0) {
#pragma unroll
      for (int gg = 0; gg < NG; ++gg) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const i32 j = p + 8 * gg + 2 * t + c;
          if (j >= er.n) continue;
          const i64 r = s_list[j];
          const float ha = acc[gg][c], hb = acc[gg][2 + c];  // rows g, g + 8
          if constexpr (kGated) {
            const i32 o = o0 + g;
            if (o < I) {
              const float gate = ha + (b1 ? b1[(i64)e * N1 + na] : 0.0f);
              float lin = hb;
              if constexpr (GATE == GATE_FC3) lin += b3 ? b3[(i64)e * I + nb] : 0.0f;
              else lin += b1 ? b1[(i64)e * N1 + nb] : 0.0f;
              act[r * I + o] = Traits<T>::from_float(act_gated<ACT>(gate, lin, ap));
            }
          } else {
            if (o0 + g < I) act[r * I + o0 + g] = Traits<T>::from_float(act1<ACT>(ha + (b1 ? b1[(i64)e * N1 + na] : 0.0f)));
            if (o0 + g + 8 < I)
              act[r * I + o0 + g + 8] = Traits<T>::from_float(act1<ACT>(hb + (b1 ? b1[(i64)e * N1 + nb] : 0.0f)));
          }
        }
      }
    }
  }
}

template <typename T, typename ScaleT, int B2, int Z2, int BLOCK, int NG>
__global__ void __launch_bounds__(kMmaThreads, mma_min_blocks<NG>())
fc2_mma_combine(const T* __restrict__ act, const i32* __restrict__ ids, const float* __restrict__ wts, i32 R, i32 k,
                i32 H, i32 I, i32 KS, const u8* __restrict__ w2, const ScaleT* __restrict__ s2,
                const u8* __restrict__ z2, const float* __restrict__ b2, float zp_offset, float* __restrict__ y,
                u32* __restrict__ counters, T* __restrict__ out) {
  __shared__ i32 s_ids[kMmaMaxRoutes], s_list[kMmaMaxRoutes], s_n;
  __shared__ float red[kMmaWarps * NG * 4 * 32];
  __shared__ bool s_last;
  extern __shared__ __align__(16) u8 dyn_smem[];
  using Stage = MmaStage<B2, ScaleT, BLOCK, Z2 == ZP_PACKED>;
  check_ring_size<Stage>();
  const i32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const i32 MT = kMmaWarps / KS, mt = warp % MT, ks = warp / MT;
  const i32 g = lane >> 2, t = lane & 3;
  const i32 e = ids[blockIdx.y];
  const i32 n0 = (blockIdx.x * MT + mt) * 16;
  const i32 na = min(n0 + g, H - 1), nb = min(n0 + g + 8, H - 1);
  const QuantParams<ScaleT, B2, BLOCK, Z2> q2{s2, z2, zp_offset, H, I};
  const i64 row_bytes = packed_bytes<B2>(I);
  const u8* pa = w2 + ((i64)e * H + na) * row_bytes;
  const u8* pb = w2 + ((i64)e * H + nb) * row_bytes;
  if (R <= kMmaPrefetchRoutes) prefetch_rows<B2>(pa, pb, I, ks, KS, kMmaPrefetchChunks);
  const ExpertRoutes er = collect_routes(ids, R, s_ids, s_list, &s_n);
  for (i32 p = 0; p < er.n; p += 8 * NG) {
    const T* xrow[NG];
#pragma unroll
    for (int gg = 0; gg < NG; ++gg) {
      const i32 j = p + 8 * gg + g;
      xrow[gg] = j < er.n ? act + (i64)s_list[j] * I : nullptr;
    }
    float acc[NG][4] = {};
    u8* ring = dyn_smem + warp * kMmaStages * Stage::kBytes;
    mma_rows<T, B2, NG>(q2, pa, na, q2, pb, nb, e, xrow, I, ks, KS, acc, ring);
    reduce_slices<NG>(acc, mt, ks, MT, KS, red);
    if (ks == 0) {
#pragma unroll
      for (int gg = 0; gg < NG; ++gg) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const i32 j = p + 8 * gg + 2 * t + c;
          if (j >= er.n) continue;
          const i64 r = s_list[j];
          const float wr = wts[r];
          if (n0 + g < H) y[r * H + n0 + g] = wr * (acc[gg][c] + (b2 ? b2[(i64)e * H + na] : 0.0f));
          if (n0 + g + 8 < H) y[r * H + n0 + g + 8] = wr * (acc[gg][2 + c] + (b2 ? b2[(i64)e * H + nb] : 0.0f));
        }
      }
    }
  }
  // The last of the R blocks of this H tile adds the routes' y in slot order and resets the counter.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(&counters[blockIdx.x], 1u) == (u32)(R - 1);
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const i32 rows = R / k, tile = 16 * MT, h0 = blockIdx.x * tile;
  for (i32 idx = threadIdx.x; idx < rows * tile; idx += kMmaThreads) {
    const i32 row = idx / tile, n = h0 + idx % tile;
    if (n >= H) continue;
    float v = 0.0f;
    for (i32 slot = 0; slot < k; ++slot) v += __ldcg(y + ((i64)row * k + slot) * H + n);
    out[(i64)row * H + n] = Traits<T>::from_float(v);
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0u;
}

}  // namespace qmoe
