// core/unpack.cuh: read b-bit codes (b in {1, 2, 3, 4, 8}) packed least-significant bits first.
//
// Packing (docs/contract.md): element k of a row lives in byte floor(k*b/8) at bit offset (k*b) mod 8;
// a row is ceil(K*b/8) bytes. 3-bit codes form one continuous bitstream per row and may straddle
// bytes. Zero points use the same packing along their own axis, so these helpers serve both.
//
// Groups of 8 codes starting at k0 % 8 == 0 occupy exactly b whole bytes starting at byte k0/8*b:
//   [b bytes] = codes k0 .. k0+7, code i at bits [i*b, (i+1)*b) of the little-endian word.
#pragma once

#include "core/types.cuh"

namespace qmoe {

template <int BITS> struct Bits {
  static_assert(BITS == 1 || BITS == 2 || BITS == 3 || BITS == 4 || BITS == 8, "bits must be 1, 2, 3, 4 or 8");
  static constexpr u32 kMask = (1u << BITS) - 1u;
  static constexpr int kGroupBytes = BITS;  // bytes holding 8 codes
};

// Bytes of one packed row of n codes: ceil(n*b/8).
template <int BITS> __host__ __device__ __forceinline__ i64 packed_bytes(i64 n) {
  return (n * BITS + 7) >> 3;
}

// Code k of a packed row, for any k (reads only the byte(s) holding it, never past the code).
template <int BITS> __device__ __forceinline__ u32 code_at(const u8* __restrict__ row, i64 k) {
  if constexpr (BITS == 8) {
    return row[k];
  } else if constexpr (BITS == 3) {
    const i64 bit = k * 3;
    const i64 byte = bit >> 3;
    const int off = (int)(bit & 7);
    u32 v = row[byte];
    if (off > 5) v |= (u32)row[byte + 1] << 8;  // straddles into the next byte
    return (v >> off) & Bits<3>::kMask;
  } else {
    const i64 bit = k * BITS;
    return ((u32)row[bit >> 3] >> (bit & 7)) & Bits<BITS>::kMask;
  }
}

// The b bytes holding codes [k0, k0+8) (k0 % 8 == 0) as the low 8*b bits of a u64.
// ALIGNED: (row + k0/8*b) is aligned to b bytes for b in {2, 4, 8} (one load instead of b);
// 1- and 3-bit groups are read byte by byte (3 bytes have no single aligned load).
template <int BITS, bool ALIGNED> __device__ __forceinline__ u64 load8_codes(const u8* __restrict__ row, i64 k0) {
  const u8* p = row + (k0 >> 3) * BITS;
  if constexpr (BITS == 1) {
    return p[0];
  } else if constexpr (ALIGNED && BITS == 2) {
    return *reinterpret_cast<const u16*>(p);
  } else if constexpr (ALIGNED && BITS == 4) {
    return *reinterpret_cast<const u32*>(p);
  } else if constexpr (ALIGNED && BITS == 8) {
    return *reinterpret_cast<const u64*>(p);
  } else {
    u64 w = 0;
#pragma unroll
    for (int i = 0; i < BITS; ++i) w |= (u64)p[i] << (8 * i);
    return w;
  }
}

// Split a word from load8_codes into its 8 codes.
template <int BITS> __device__ __forceinline__ void unpack8(u64 word, u32 (&q)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = (u32)(word >> (i * BITS)) & Bits<BITS>::kMask;
}

// Codes [k0, k0+8) of a row (k0 % 8 == 0, k0 + 8 <= K).
template <int BITS, bool ALIGNED> __device__ __forceinline__ void load_unpack8(const u8* __restrict__ row, i64 k0, u32 (&q)[8]) {
  unpack8<BITS>(load8_codes<BITS, ALIGNED>(row, k0), q);
}

}  // namespace qmoe
