// core/wgmma.cuh: Hopper warpgroup MMA (sm_90a) with the A operand in registers and B in shared
// memory: m64nNk16 with float16 / bfloat16 inputs, m64nNk32 with float8 e4m3 inputs (WgE4m3), f32
// accumulators, N = 16, 32, 64, 128 or 256.
//
// Register A fragment (4 x u32 per thread) of warp w of the warpgroup: the mma.sync m16n8k16 A fragment
// of rows 16w .. 16w + 15, so the exact dequantization of core/mma_pair.cuh feeds it unchanged.
// Accumulators d[N/2] of lane (g, t) of warp w: d[4j + c] = row 16w + g + 8·(c / 2), column 8j + 2t + c % 2.
// B: N rows × 16 k of a K-major tile with 128-byte swizzle (rows of 64 values, 8-row atoms of 1024 bytes,
// 16-byte unit u of row r stored at u ^ (r & 7); the atom 1024-aligned); smem_desc() describes it.
// e4m3: each A register holds four codes (rows g / g + 8, k 4t .. 4t + 3 and 16 + 4t ..); B rows are 128 codes,
// so a k32 step is 32 bytes into the row, as a k16 step of 2-byte values is.
// The operand lists are written out once per N (the instruction takes N/2 accumulator registers); one
// macro per N serves every input kind (its PTX shape and types are the argument).
// Compiled for other targets the wrappers are empty and trap: callers dispatch on sm_90a only.
#pragma once

#include "core/types.cuh"

namespace qmoe {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QMOE_HAVE_WGMMA 1
#else
#define QMOE_HAVE_WGMMA 0
#endif

// Shared-memory matrix descriptor: start address, stride between 8-row atoms (1024 B), 128-byte swizzle.
__device__ __forceinline__ u64 smem_desc(u32 saddr) {
  return (u64)((saddr & 0x3FFFF) >> 4) | ((u64)(1024 >> 4) << 32) | (1ull << 62);
}

// What k16 step s of a 128-value chunk adds to the descriptor of the chunk's route tile (two 64-value
// halves of BR rows × 128 bytes; a step is 32 bytes into its half): the start address field counts
// 16-byte units and the tile lies below 256 KB, so the step's offset adds without a carry.
template <int BR> __host__ __device__ constexpr u64 smem_desc_step(int s) {
  return (u64)(((s >> 2) * (BR * 128) + (s & 3) * 32) >> 4);
}

__device__ __forceinline__ void wgmma_fence() {
#if QMOE_HAVE_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if QMOE_HAVE_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_wait() {
#if QMOE_HAVE_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// The accumulators are written by the asynchronous MMA: keep the compiler from moving their reads
// and writes across wgmma_wait (the registers are "+f" operands of an asm it cannot see into).
template <int NA> __device__ __forceinline__ void wgmma_hold(float (&d)[NA]) {
#pragma unroll
  for (int i = 0; i < NA; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <typename T, int N> struct Wgmma;

#if QMOE_HAVE_WGMMA
// Accumulator operands of the asm: QMOE_WG_F32(i) = "+f"(d[i]) ... "+f"(d[i + 31]).
#define QMOE_WG_F4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define QMOE_WG_F8(i) QMOE_WG_F4(i), QMOE_WG_F4(i + 4)
#define QMOE_WG_F16(i) QMOE_WG_F8(i), QMOE_WG_F8(i + 8)
#define QMOE_WG_F32(i) QMOE_WG_F16(i), QMOE_WG_F16(i + 16)
// Their place holders in the instruction: %0 .. %(N/2 - 1).
#define QMOE_WG_D8 "%0, %1, %2, %3, %4, %5, %6, %7"
#define QMOE_WG_D16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define QMOE_WG_D32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15," \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define QMOE_WG_D64 QMOE_WG_D32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47," \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define QMOE_WG_D128 QMOE_WG_D64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79," \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95," \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111," \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// d[N/2] += A (registers, operands AREGS) · B (descriptor, DESC), one instruction of SHAPE_TYPES ("k16.f32.f16.f16",
// "k16.f32.bf16.bf16": the last immediate, B's transpose, is 0; "k32.f32.e4m3.e4m3": 8-bit types take no transpose
// immediates); the predicate (operand PRED) is scale_d != 0 (0 overwrites d). The accumulator operands come last
// (__VA_ARGS__).
#define QMOE_WGMMA_K(N, SHAPE_TYPES, IMMS, DREGS, AREGS, DESC, PRED, ...) \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n" \
               "wgmma.mma_async.sync.aligned.m64n" #N SHAPE_TYPES " {" DREGS "}, {" AREGS "}, " \
               DESC ", p, 1, 1" IMMS ";\n}\n" \
               : __VA_ARGS__ \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))
// One operand kind a macro: f16 and bf16 in k16 steps, e4m3 (A and B float8 e4m3fn) in k32 steps.
#define QMOE_WGMMA_OP_f16(N, ...) QMOE_WGMMA_K(N, "k16.f32.f16.f16", ", 0", __VA_ARGS__)
#define QMOE_WGMMA_OP_bf16(N, ...) QMOE_WGMMA_K(N, "k16.f32.bf16.bf16", ", 0", __VA_ARGS__)
#define QMOE_WGMMA_OP_e4m3(N, ...) QMOE_WGMMA_K(N, "k32.f32.e4m3.e4m3", "", __VA_ARGS__)
#define QMOE_WGMMA_16(OP) OP(16, QMOE_WG_D8, "%8, %9, %10, %11", "%12", "%13", QMOE_WG_F8(0))
#define QMOE_WGMMA_32(OP) OP(32, QMOE_WG_D16, "%16, %17, %18, %19", "%20", "%21", QMOE_WG_F16(0))
#define QMOE_WGMMA_64(OP) OP(64, QMOE_WG_D32, "%32, %33, %34, %35", "%36", "%37", QMOE_WG_F32(0))
#define QMOE_WGMMA_128(OP) \
  OP(128, QMOE_WG_D64, "%64, %65, %66, %67", "%68", "%69", QMOE_WG_F32(0), QMOE_WG_F32(32))
#define QMOE_WGMMA_256(OP) \
  OP(256, QMOE_WG_D128, "%128, %129, %130, %131", "%132", "%133", QMOE_WG_F32(0), QMOE_WG_F32(32), \
     QMOE_WG_F32(64), QMOE_WG_F32(96))
#define QMOE_WGMMA_CALL(N, KIND) QMOE_WGMMA_##N(QMOE_WGMMA_OP_##KIND)
#else
#define QMOE_WGMMA_CALL(N, TY) ((void)d, (void)a, (void)desc, (void)scale_d, __trap())
#endif

// Wgmma<T, N>::mma(d, a, desc, scale_d): one m64nNk16 MMA of the warpgroup (T = WgE4m3: m64nNk32, A and B
// float8 e4m3fn, A's four registers holding 16 codes; issue only: commit and wait with wgmma_commit / wgmma_wait).
struct WgE4m3 {};  // the operand kind of FP8 MMAs (no CUDA type is needed: the codes are bytes)
#define QMOE_WGMMA_STRUCT(CPP, KIND, N) \
  template <> struct Wgmma<CPP, N> { \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], const u32 (&a)[4], u64 desc, int scale_d = 1) { \
      QMOE_WGMMA_CALL(N, KIND); \
    } \
  };
#define QMOE_WGMMA_STRUCTS(CPP, KIND) \
  QMOE_WGMMA_STRUCT(CPP, KIND, 16) QMOE_WGMMA_STRUCT(CPP, KIND, 32) QMOE_WGMMA_STRUCT(CPP, KIND, 64) \
  QMOE_WGMMA_STRUCT(CPP, KIND, 128) QMOE_WGMMA_STRUCT(CPP, KIND, 256)
QMOE_WGMMA_STRUCTS(__half, f16)
QMOE_WGMMA_STRUCTS(__nv_bfloat16, bf16)
QMOE_WGMMA_STRUCTS(WgE4m3, e4m3)

// The dynamic shared memory of a kernel whose ring needs `bytes` from a 1024-aligned start (the 128-byte
// swizzle atoms): the aligned start; traps when the launch gave less than bytes + 1024.
template <int BYTES> __device__ __forceinline__ u8* wg_smem(u8* dyn) {
  u32 have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (have < (u32)(BYTES + 1024)) __trap();
  const u32 a = (u32)__cvta_generic_to_shared(dyn);
  return dyn + ((1024u - (a & 1023u)) & 1023u);
}

}  // namespace qmoe
