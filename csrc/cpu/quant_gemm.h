// Weight-quantized matmuls, out[M, N] (fp32) = x[M, K] (fp32) @ W[N, K]^T, per ISA path.
//
// Weights come in groups of 32 input features (K % 32 == 0), one fp32 scale per group:
//   int4: w = code * scale + min, codes 0..15; the 16 bytes of a group hold element j in the
//         low nibble of byte j and element j + 16 in its high nibble (GGUF Q4_1's order, so a
//         register of 16 bytes unpacks into the group's 32 codes in order with two ANDs).
//   int8: w = code * scale, codes -127..127 (GGUF Q8_0's grid).
// Two ways to multiply, both accumulating in fp32:
//   * kF32: dequantize each weight group in registers and FMA it with the fp32 activations;
//   * kInt8: quantize each activation row per group of 32 to int8 (scale = max|x| / 127,
//     round to nearest even, as GGUF Q8_1) and take integer dot products of the codes
//     (AVX2 vpmaddubsw, NEON sdot), scaled once per group; the int4 min term uses the
//     group's activation sum. Fewer instructions per weight, at the price of the activation
//     rounding.
// Plain C++ (no torch): tests/cpu_isa/driver.cpp checks every path against the scalar one.
#pragma once

#include <cstdint>

#include "isa.h"

namespace core_cpu {

constexpr int64_t kQuantGroup = 32;

enum class ActMode : int { kF32 = 0, kInt8 = 1 };

struct QuantWeights {
  int bits;              // 4 or 8
  const uint8_t* codes;  // int4: [N, K / 2]; int8: [N, K] (int8 values)
  const void* scales;    // [N, K / 32] float32, or IEEE float16 bits when `half`
  const void* mins;      // int4: [N, K / 32] like scales; int8: unused
  int64_t n, k;
  bool half = false;     // scales and mins stored as float16 (GGUF's own width: 20 % fewer
                         // bytes per int4 weight than fp32, read once per decode step)
};

// IEEE binary16 bits -> float, exactly (portable: the per-group scales are not the hot loop).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24 is exact in float
    const float f = static_cast<float>(mant) * (1.0f / 16777216.0f);
    __builtin_memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  __builtin_memcpy(&out, &bits, 4);
  return out;
}

inline float scale_of(const QuantWeights& w, int64_t i) {
  return w.half ? half_to_float(static_cast<const uint16_t*>(w.scales)[i]) : static_cast<const float*>(w.scales)[i];
}
inline float min_of(const QuantWeights& w, int64_t i) {
  return w.half ? half_to_float(static_cast<const uint16_t*>(w.mins)[i]) : static_cast<const float*>(w.mins)[i];
}

// Activation rows quantized by quantize_rows (ActMode::kInt8).
struct QuantActs {
  const int8_t* q;  // [M, K]
  const float* d;   // [M, K / 32] scales
  const float* s;   // [M, K / 32] d * sum of the group's codes (the int4 min term)
};

// Rows [m0, m1) of x [*, K] (row stride ldx) into q/d/s laid out as QuantActs (stride K).
void quantize_rows(Isa isa, const float* x, int64_t ldx, int64_t k, int64_t m0, int64_t m1, int8_t* q, float* d,
                   float* s);

// out[m, n] for m in [m0, m1), n in [n0, n1); out row stride ldo.
void quant_gemm_f32(Isa isa, float* out, int64_t ldo, const float* x, int64_t ldx, int64_t m0, int64_t m1,
                    const QuantWeights& w, int64_t n0, int64_t n1);
// The int8 mode's two x86 kernels (quant_gemm.cpp): tiles of <= 4 rows x 2-4 weight rows for
// a few activation rows (decode), or panels of 8 weight rows unpacked once and reused by every
// row (prompts, decode batches). kAuto takes panels from kPanelMinRows rows: single-core time
// on SmolLM2's shapes (docs/benchmarks/cpu.md), int4 panels 0.7-0.9x the tiles' speed at 2
// rows, 1.2-1.3x at 4, 2.5-2.9x at 32; int8 0.8-1.0x up to 4 rows, 1.2x at 5, 1.5x at 32.
// Other paths have one kernel.
enum class Int8Kernel : int { kAuto = 0, kTiles = 1, kPanels = 2 };
constexpr int64_t kPanelMinRows4 = 4, kPanelMinRows8 = 5;

void quant_gemm_int8(Isa isa, float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t m1,
                     const QuantWeights& w, int64_t n0, int64_t n1, Int8Kernel kernel = Int8Kernel::kAuto);

}  // namespace core_cpu
