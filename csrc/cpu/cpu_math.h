// Scalar helpers shared by the CPU kernels: bf16 <-> fp32 and a vectorisable exp.
//
// Plain C++ (no torch headers), written so that GCC/Clang at -O3 -march=native turn the
// loops that call them into AVX-512 / AVX2 code: no branches the vectoriser cannot turn into
// masks, no library calls (libm's expf is not vectorised without -ffast-math).
#pragma once

#include <cstdint>
#include <cstring>

namespace core_cpu {

// bfloat16 elements are handled as their raw bits (the top half of an fp32): a plain
// integer type the vectoriser can load, unlike c10::BFloat16's struct.
using bf16_t = uint16_t;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) { return bits_to_float(static_cast<uint32_t>(v) << 16); }

// Conversion to the storage type; returns by value so vectorised loops need no scratch.
template <typename T>
T from_f32(float v);

template <>
inline float from_f32<float>(float v) {
  return v;
}

// Round to nearest even, as torch's .to(torch.bfloat16); NaN stays a (quiet) NaN.
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  uint32_t u = float_to_bits(v);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<bf16_t>(v != v ? 0x7FC0u : rounded);
}

// exp(x) to ~2 ulp for x in [-87.3, 88]; 0 below (softmax weights, silu), clamped above.
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, then a degree-7 Taylor polynomial
// (truncation error < 1e-8 relative on that interval). n is rounded with the 1.5 * 2^23
// trick instead of floorf, which GCC does not vectorise under default math flags.
inline float fast_exp(float x) {
  const float lo = -87.33654f, hi = 88.0f, magic = 12582912.0f;
  float xc = x < lo ? lo : (x > hi ? hi : x);
  float shifted = xc * 1.44269504088896341f + magic;  // round(x / ln2) in the low bits
  float n = shifted - magic;
  float r = xc - n * 0.693359375f;  // ln2 split into an exact high part ...
  r = r - n * -2.12194440e-4f;      // ... and the low remainder
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uint32_t ni = float_to_bits(shifted) - float_to_bits(magic);  // n as a two's complement int
  float y = p * bits_to_float((ni + 127u) << 23);
  return x < lo ? 0.0f : y;
}

// sum(a[i] * b[i]). Sixteen partial sums give the vectoriser one independent accumulator per
// lane (a plain `s += ...` loop is not vectorised: it would reorder the float additions).
inline float dot(const float* a, const float* b, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) part[l] += a[i + l] * b[i + l];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int l = 0; l < 16; ++l) s += part[l];
  return s;
}

inline float sum(const float* a, int64_t n) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) part[l] += a[i + l];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i];
  for (int l = 0; l < 16; ++l) s += part[l];
  return s;
}

inline float max_of(const float* a, int64_t n) {
  float m = a[0];
  int64_t i = 0;
  if (n >= 16) {
    float part[16];
    for (int l = 0; l < 16; ++l) part[l] = a[l];
    for (i = 16; i + 16 <= n; i += 16) {
      for (int l = 0; l < 16; ++l) part[l] = part[l] > a[i + l] ? part[l] : a[i + l];
    }
    for (int l = 0; l < 16; ++l) m = m > part[l] ? m : part[l];
  }
  for (; i < n; ++i) m = m > a[i] ? m : a[i];
  return m;
}

// s = softmax(s), in place; n >= 1.
inline void softmax_inplace(float* s, int64_t n) {
  const float m = max_of(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] = fast_exp(s[i] - m);
  const float inv = 1.0f / sum(s, n);
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

inline float silu(float x) { return x / (1.0f + fast_exp(-x)); }

}  // namespace core_cpu
