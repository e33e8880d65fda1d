// Element types of the kernels: how a 16-byte vector of each unpacks to floats and how a
// float packs back. Kernels are templated on these tags, never on toolkit half types.
#pragma once

#include "cuda_compat.h"

namespace core_kernels {

__device__ __forceinline__ void unpack_words(const uint4& v, uint32_t (&w)[4]) {
  w[0] = v.x;
  w[1] = v.y;
  w[2] = v.z;
  w[3] = v.w;
}

struct Fp16 {
  using Storage = uint16_t;
  static constexpr int kVec = 8;  // elements per 16 bytes
  __device__ __forceinline__ static void to_float(const uint4& v, float (&f)[kVec]) {
    uint32_t w[4];
    unpack_words(v, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = half2_bits_to_float2(w[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static float to_float1(Storage x) { return half2_bits_to_float2(x).x; }
  __device__ __forceinline__ static Storage from_float(float x) { return float_to_half_bits(x); }
};

struct Bf16 {
  using Storage = uint16_t;
  static constexpr int kVec = 8;
  // bf16 is the top half of an fp32: widening is a shift (low element) or a mask (high).
  __device__ __forceinline__ static void to_float(const uint4& v, float (&f)[kVec]) {
    uint32_t w[4];
    unpack_words(v, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  __device__ __forceinline__ static float to_float1(Storage x) {
    return __uint_as_float(static_cast<uint32_t>(x) << 16);
  }
  // Round to nearest even; NaN stays a (quiet) NaN.
  __device__ __forceinline__ static Storage from_float(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<Storage>(0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<Storage>(u >> 16);
  }
};

struct Fp32 {
  using Storage = float;
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void to_float(const uint4& v, float (&f)[kVec]) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static float to_float1(Storage x) { return x; }
  __device__ __forceinline__ static Storage from_float(float x) { return x; }
};

#if CORE_HAS_FP8_KV
// float8 e4m3 codes of the FP8 KV cache: 16 per 16-byte vector. Never a query or output type:
// the decode kernel reads it as its cache type (scales applied outside, see paged_decode.cuh).
struct Fp8E4m3 {
  using Storage = uint8_t;
  static constexpr int kVec = 16;
  __device__ __forceinline__ static void to_float(const uint4& v, float (&f)[kVec]) {
    uint32_t w[4];
    unpack_words(v, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 lo = fp8x2_e4m3_bits_to_float2(static_cast<uint16_t>(w[i] & 0xffffu));
      const float2 hi = fp8x2_e4m3_bits_to_float2(static_cast<uint16_t>(w[i] >> 16));
      f[4 * i] = lo.x;
      f[4 * i + 1] = lo.y;
      f[4 * i + 2] = hi.x;
      f[4 * i + 3] = hi.y;
    }
  }
  __device__ __forceinline__ static Storage from_float(float x) { return float_to_fp8_e4m3_bits(x); }
};
#endif

}  // namespace core_kernels
