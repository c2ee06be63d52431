// core/mma_pair.cuh: two values of T (float16 / bfloat16) in one 32-bit register -- exact integer
// codes, scales, the mma.sync m16n8k16 they feed -- and the exact in-register dequantization of one
// lane's 32 codes of a weight row into mma A-fragment pairs.
//
// Dequantization: (magic | q) − (magic + zp) is exact in f16 (magic 1024) and bf16 (magic 128, q < 128);
// bf16 with 8-bit codes goes through float32 ((2^23 | q) − (2^23 + zp)), rounded once (exact: |q − zp| ≤ 255).
// FP8 (e4m3fn codes, MmaDeq<T, 8, ZP_FP8>): int8's pairs (bytes j and j + 2 of a word), converted by
// cvt.rn.f16x2.e4m3x2 (sm_89+; the low byte becomes the low half), exact in f16; bf16 goes through
// float32 (exact: every e4m3 value is a bf16 value). NaN codes stay NaN. Below sm_89 (the engines
// refuse FP8 there) the same values come from e4m3_to_float.
// FP4 (e2m1 codes, MmaDeq<T, 4, ZP_FP4>): int4's pairs, each code's exponent and mantissa bits placed at
// the top of T's exponent field's low bits and mantissa (f16 bits 11-9, bf16 bits 8-6) and its sign at bit
// 15: exactly e2m1 · 2^-14 (f16) or e2m1 · 2^-126 (bf16), e2m1's subnormal 0.5 landing on T's subnormal;
// one exact multiply by 2^14 / 2^126 (T's multiplies keep subnormals) gives the value.
// A lane holds 32 consecutive codes of a row (4·b bytes); pair i is the codes (c, c + 16/b) with
// c = first_code(i), which is the order the shifts and masks produce them in; the activations are
// permuted the same way (x_pair), so the mma's k index needs no shuffle. 3-bit codes (one 96-bit
// string per lane, codes straddling words) take 4-bit's pair order: pair i = (c, c + 4), each pair cut
// out of the string by one 32-bit funnel-shift window.
#pragma once

#include "core/codes.cuh"
#include "core/dequant.cuh"
#include "core/types.cuh"

namespace qmoe {

// (x & mask) | bits in one LOP3. Written in C, the two constants cannot both be immediates of one LOP3
// and ptxas emits two (H200 ncu: two LOP3 a pair in fc1_wgmma's loop, the ALU pipe the
// busiest); held in registers, they feed one three-input LOP3 (0xEA = a & b | c).
__device__ __forceinline__ u32 and_or(u32 x, u32 mask, u32 bits) {
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(x), "r"(mask), "r"(bits));
  return d;
}

// Two values of T in one u32: exact integer codes, scale multiply, mma.
template <typename T> struct Pair2;

template <> struct Pair2<__half> {
  static constexpr u32 kMagic = 0x64006400u;  // half2(1024, 1024): (magic | q) = 1024 + q, q < 1024
  static constexpr float kMagicF = 1024.0f;
  static constexpr u32 kMagicByte = 0x64646464u;
  static constexpr u32 kSixteenthOne = 0x3C002C00u;  // half2(1/16, 1)
  static constexpr int kFp4Shift = 9;                 // e2m1 exponent / mantissa bits -> bits 11-9: e2m1 · 2^-14
  static constexpr u32 kFp4Unit = 0x74007400u;        // half2(2^14, 2^14)
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
  static constexpr u32 kSixteenthOne = 0x3F803D80u;  // bf16x2(1/16, 1)
  static constexpr int kFp4Shift = 6;                 // e2m1 exponent / mantissa bits -> bits 8-6: e2m1 · 2^-126
  static constexpr u32 kFp4Unit = 0x7E807E80u;        // bf16x2(2^126, 2^126)
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
  static __device__ __forceinline__ u32 fma(u32 a, u32 b, u32 c) {  // a * b + c
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
  static __device__ __forceinline__ u32 mul(u32 a, u32 b) {  // a * b + (-0): the sm_80 form of a multiply
    return fma(a, b, 0x80008000u);
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
  u32 zph;  // float16 4-bit: splat of -(magic/16 + zp), the addend for codes read as 16·q;
            // 3-bit: (-(magic/16 + zp), -(magic + zp)), the addend for pairs read as (16·q, q)
  u32 sc;   // T2 splat of scale
  float zpf;  // float32 path: 2^23 + zp
  float scf;  // scale
};

// Two e4m3fn codes (low byte: the low half) as f16x2, exact; NaN codes give NaN.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  u32 d;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(d) : "h"((u16)two));
  return d;
#else
  return Pair2<__half>::pack(e4m3_to_float(two & 0xffu), e4m3_to_float((two >> 8) & 0xffu));
#endif
}

// Two e2m1 codes (bits 0-3 and 16-19 of x) as T2 holding e2m1 · 2^-14 (f16) / 2^-126 (bf16), exact (see
// the file comment).
template <typename T> __device__ __forceinline__ u32 e2m1x2_bits(u32 x) {
  return ((x & 0x00070007u) << Pair2<T>::kFp4Shift) | ((x & 0x00080008u) << 12);
}

// FP4: codes in the pair order of 4-bit integers (nibbles j and j + 4 of a word), scaled or not.
template <typename T, bool SCALED> __device__ __forceinline__ u32 fp4_pair(u32 word, int j, const Coef& cf) {
  const u32 v = Pair2<T>::mul(e2m1x2_bits<T>(word >> (4 * j)), Pair2<T>::kFp4Unit);  // the e2m1 values
  return SCALED ? Pair2<T>::mul(v, cf.sc) : v;
}

// FP8: codes in the pair order of 8-bit integers, scaled or not (see the file comment).
template <typename T, bool SCALED> __device__ __forceinline__ u32 fp8_pair(u32 word, int j, const Coef& cf) {
  const u32 h = e4m3x2_to_f16x2(__byte_perm(word, 0u, 0x4420 + 0x11 * j));  // bytes j, j + 2
  if constexpr (Pair2<T>::kMagicByte != 0) {  // float16: the converted pair as it is
    return SCALED ? Pair2<__half>::mul(h, cf.sc) : h;
  } else {
    const __half2 hh = *reinterpret_cast<const __half2*>(&h);
    const float lo = __low2float(hh), hi = __high2float(hh);
    return SCALED ? Pair2<T>::pack(lo * cf.scf, hi * cf.scf) : Pair2<T>::pack(lo, hi);
  }
}

// ZP: the projection's decode trait (core/dequant.cuh): ZP_FP8 / ZP_FP4 codes are float codes, the
// others integers.
template <typename T, int B, int ZP = ZP_NONE> struct MmaDeq {
  static constexpr bool FP8 = ZP == ZP_FP8;
  static constexpr bool FP4 = ZP == ZP_FP4;
  static_assert(!FP8 || B == 8, "FP8 codes are 8-bit");
  static_assert(!FP4 || B == 4, "FP4 codes are 4-bit");
  static_assert(B == 1 || B == 2 || B == 3 || B == 4 || B == 8, "1/2/3/4/8-bit codes");
  static constexpr bool kF32 = B == 8 && Pair2<T>::kMagicByte == 0;  // bf16 with 8-bit codes
  static constexpr int kOrder = B == 3 ? 4 : B;                        // 3-bit codes pair as 4-bit ones do
  static constexpr int kPairsPerWord = 16 / kOrder;                    // pair i = codes (c, c + kPairsPerWord)
  static constexpr int kCodesPerWord = 32 / kOrder;

  static __device__ __forceinline__ Coef coef(ScaleZp s) {
    Coef c;
    if constexpr (FP8 || FP4) {
      c.zpm = c.zph = 0;
      c.sc = Pair2<T>::splat(s.scale);  // float16: the scaled pairs' multiplier
      c.zpf = 0.0f;
      c.scf = s.scale;  // bfloat16 scaled pairs, and the mma's partial sums when unscaled
    } else if constexpr (kF32) {
      c.zpf = 8388608.0f + s.zp;
      c.scf = s.scale;
      c.zpm = c.zph = c.sc = 0;
    } else {
      c.zpm = Pair2<T>::splat(Pair2<T>::kMagicF + s.zp);
      c.zph = B == 3 ? Pair2<T>::pack(-(Pair2<T>::kMagicF / 16.0f + s.zp), -(Pair2<T>::kMagicF + s.zp))
                     : Pair2<T>::splat(-(Pair2<T>::kMagicF / 16.0f + s.zp));
      c.sc = Pair2<T>::splat(s.scale);
      c.zpf = 0.0f;
      c.scf = s.scale;  // applied to the mma's partial sums when the scale is constant over a chunk
    }
    return c;
  }
  static __device__ __forceinline__ Coef zero() {
    Coef c;
    c.zpm = kF32 ? 0u : Pair2<T>::kMagic;
    c.zph = kF32 ? 0u
                 : (B == 3 ? Pair2<T>::pack(-Pair2<T>::kMagicF / 16.0f, -Pair2<T>::kMagicF)  // zero codes -> 0
                           : Pair2<T>::splat(-Pair2<T>::kMagicF / 16.0f));  // (magic | 0)/16 + zph = 0
    c.sc = 0u;
    c.zpf = 8388608.0f;
    c.scf = 0.0f;
    return c;
  }
  // Position of pair i's first code within the lane's 32 stored codes (the second is kPairsPerWord further).
  static __device__ __forceinline__ constexpr int first_code(int i) {
    return (i / kPairsPerWord) * kCodesPerWord + i % kPairsPerWord;
  }
  // Which of the lane's 32 codes (natural k order) pair i holds: codes (low_code(i), low_code(i) +
  // kPairStep). The contract layout stores codes in natural order, so a pair is what the shifts give,
  // (first_code(i), + kPairsPerWord); the tiled layout (core/codes.cuh) stores natural codes 2i and
  // 2i + 1 at those positions, so a pair is two neighbours and its activations are one word of x.
  static constexpr int kPairStep = kTiled ? 1 : kPairsPerWord;
  static __device__ __forceinline__ constexpr int low_code(int i) { return kTiled ? 2 * i : first_code(i); }
  // Pair i (0..15) of the lane's 32 codes as T2 for codes (c, c + kPairsPerWord): (q - zp) * scale, or
  // the exact (q - zp) when !SCALED (the caller scales the mma's partial sums).
  template <bool SCALED>
  static __device__ __forceinline__ u32 pair(const u32 (&w)[B], int i, const Coef& cf) {
    const int word = i / kPairsPerWord, j = i % kPairsPerWord;
    if constexpr (B == 3) {
      // codes c and c + 4 are bits 3c and 3c + 12 of the lane's 96-bit string w[0] | w[1] << 32 | w[2] << 64:
      // the 32-bit window from bit 3c - 4 holds them at bits 4..6 and 16..18, read in place as
      // (magic | 16·q_c, magic | q_c+4) and brought to q - zp by one exact fma:
      // × (1/16, 1) + (-(magic/16 + zp), -(magic + zp)). i is a constant once unrolled, so is the window.
      const int o = 3 * first_code(i) - 4;
      u32 win;
      if (o < 0) win = w[0] << -o;
      else if (o >= 64) win = w[2] >> (o - 64);
      else win = __funnelshift_r(w[o >> 5], w[(o >> 5) + 1], o & 31);
      const u32 v = and_or(win, 0x00070070u, Pair2<T>::kMagic);
      const u32 d = Pair2<T>::fma(v, Pair2<T>::kSixteenthOne, cf.zph);
      return SCALED ? Pair2<T>::mul(d, cf.sc) : d;
    } else if constexpr (FP8) {
      return fp8_pair<T, SCALED>(w[word], j, cf);
    } else if constexpr (FP4) {
      return fp4_pair<T, SCALED>(w[word], j, cf);
    } else if constexpr (kF32) {
      const float lo = __int_as_float(__byte_perm(w[word], 0x4B000000u, 0x7440 + j)) - cf.zpf;
      const float hi = __int_as_float(__byte_perm(w[word], 0x4B000000u, 0x7442 + j)) - cf.zpf;
      return SCALED ? Pair2<T>::pack(lo * cf.scf, hi * cf.scf) : Pair2<T>::pack(lo, hi);
    } else if constexpr (B == 4 && Pair2<T>::kMagicByte != 0) {
      // float16, 4-bit: pairs 0/2 of a word are (magic | q) at nibbles 0 and 2 of each half; pairs 1/3
      // are read in place as (magic | 16·q) and brought to q - zp by one exact fma (x/16 - (64 + zp)):
      // one shift per word instead of three. Kept as C (two LOP3s): and_or here holds two masks in registers,
      // which spilled 16-20 bytes in the 128-route wgmma kernels
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
      else v = and_or(w[word] >> (B * j), ((1u << B) - 1u) * 0x00010001u, Pair2<T>::kMagic);
      return SCALED ? Pair2<T>::sub_mul(v, cf.zpm, cf.sc) : Pair2<T>::sub(v, cf.zpm);
    }
  }
  // The A fragment of k16 step s (mma.sync m16n8k16; one warp's share of wgmma's m64) from a lane's two
  // rows: pairs 2s and 2s + 1 of row a (codes wa, coefficients ca of each scale block of its 32 codes)
  // and of row b, each pair with the coefficients of the block it lies in (NSB = 2: blocks of 16 codes).
  template <bool SCALED, int NSB>
  static __device__ __forceinline__ void fragment(u32 (&f)[4], const u32 (&wa)[B], const u32 (&wb)[B],
                                                  const Coef (&ca)[NSB], const Coef (&cb)[NSB], int s) {
    const int h0 = NSB == 2 ? low_code(2 * s) / 16 : 0, h1 = NSB == 2 ? low_code(2 * s + 1) / 16 : 0;
    f[0] = pair<SCALED>(wa, 2 * s, ca[h0]);
    f[1] = pair<SCALED>(wb, 2 * s, cb[h0]);
    f[2] = pair<SCALED>(wa, 2 * s + 1, ca[h1]);
    f[3] = pair<SCALED>(wb, 2 * s + 1, cb[h1]);
  }
  // The activations of pair i: (x[c], x[c + kPairStep]), c = low_code(i), from the lane's 32 activations
  // xw (16 words): one byte permute, none when tiled.
  static __device__ __forceinline__ u32 x_pair(const u32 (&xw)[16], int i) {
    if constexpr (kTiled) return xw[i];
    const int c1 = first_code(i), c2 = c1 + kPairsPerWord;
    const u32 lo = (c1 & 1) * 2, hi = 4 + (c2 & 1) * 2;
    return __byte_perm(xw[c1 >> 1], xw[c2 >> 1], lo | ((lo + 1) << 4) | (hi << 8) | ((hi + 1) << 12));
  }
};

// A lane's 32 codes of one row as B words, from shared memory (4·B bytes at p; 16-byte aligned for
// B >= 4, 4·B-byte aligned for 1/2-bit, 4-byte aligned for 3-bit).
template <int B> __device__ __forceinline__ void lds_codes(const u8* p, u32 (&w)[B]) {
  if constexpr (B == 3) {
    const u32* q = reinterpret_cast<const u32*>(p);
    w[0] = q[0]; w[1] = q[1]; w[2] = q[2];
  } else if constexpr (4 * B >= 16) {
#pragma unroll
    for (int q = 0; q < B / 4; ++q) {
      const uint4 v = *reinterpret_cast<const uint4*>(p + 16 * q);
      w[4 * q] = v.x; w[4 * q + 1] = v.y; w[4 * q + 2] = v.z; w[4 * q + 3] = v.w;
    }
  } else if constexpr (B == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const u32*>(p);
  }
}

}  // namespace qmoe
