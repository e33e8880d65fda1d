// Host entry points of the weight-only quantized linear kernels (core.quantization's
// IntWeight and Fp8Weight forms, packed by platforms/cuda/quant.py). Plain C++ over raw
// pointers like launchers.h: no torch types cross this line.
//
// Weight layout, per output row n (row-major, rows of `row_bytes` bytes):
//   kInt4: k / 2 bytes; byte j holds input 2j in its low nibble and 2j + 1 in its high one;
//          w = code * scale + min (min optional: nullptr means 0).
//   kInt8: k int8 codes; w = code * scale.
//   kFp8:  k float8 e4m3 (OCP "fn": no infinities) codes; w = code * scale.
// scales / mins: float32 [n, k / group] (group = k: one scale per row). Groups must span
// whole 16-byte code vectors: group % 32 == 0 for kInt4, group % 16 == 0 otherwise, and
// k % 32 == 0.
//
// Activations x and the output are fp16, bf16 or fp32 (`dtype`), rows contiguous and 16-byte
// aligned; accumulation is float32, the output rounded once.
#pragma once

#include <cstdint>

#include "../launchers.h"

namespace core_kernels {

enum class QuantCode : int { kInt4 = 0, kInt8 = 1, kFp8 = 2 };

struct QuantGemvArgs {
  void* out;              // [m, n], contiguous
  const void* x;          // [m, k], row stride x_stride elements
  const uint8_t* codes;   // [n, row_bytes]
  const float* scales;    // [n, k / group]
  const float* mins;      // [n, k / group] or nullptr
  int64_t x_stride;
  int m, n, k, group;
  QuantCode code;
  DType dtype;
};

// out = x @ W^T for m <= kQuantGemvMaxRows rows (decode steps): each warp streams one weight
// row once for all m activation rows. Returns cudaErrorInvalidValue for shapes outside the
// contract above.
constexpr int kQuantGemvMaxRows = 16;
cudaError_t quant_gemv(const QuantGemvArgs& args, cudaStream_t stream);

struct QuantDequantArgs {
  void* out;              // [n, k] contiguous, `dtype`
  const uint8_t* codes;
  const float* scales;
  const float* mins;
  int n, k, group;
  QuantCode code;
  DType dtype;
};

// W itself, dequantized (for prefill: dequantize once, then one dense GEMM).
cudaError_t quant_dequant(const QuantDequantArgs& args, cudaStream_t stream);

}  // namespace core_kernels
