// Host entry points of the weight-only quantized linear kernels (core.quantization's
// IntWeight and Fp8Weight forms, packed by platforms/cuda/quant.py). Plain C++ over raw
// pointers like launchers.h: no torch types cross this line.
//
// Weight layout, per output row n (row-major, rows of `row_bytes` bytes):
//   kInt4: k / 2 bytes; byte j holds input 2j in its low nibble and 2j + 1 in its high one;
//          w = code * scale + min (min optional: nullptr means 0).
//   kInt8: k int8 codes; w = code * scale (quant_gemv: mins must be nullptr; quant_dequant
//          adds them).
//   kFp8:  k float8 e4m3 (OCP "fn": no infinities) codes; w = code * scale (mins nullptr).
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
  const uint8_t* zeros;   // int4 with mins only, optional: [n, k / group] zero points z < 128
                          // with mins == -z * scale exactly (w = (code - z) * scale), or
                          // nullptr; trusted: the tensor cores use them, the CUDA cores the mins
  int64_t x_stride;
  int m, n, k, group;
  QuantCode code;
  DType dtype;
  bool tensor_cores;      // fp8 and int4: allow the tensor-core kernels where they apply
  // Epilogues pairing two rows (paired_epilogue.cuh), one activation row of fp16/bf16 only,
  // on the CUDA-core kernel: silu_and_mul (the weight is [gate | up], out [1, n / 2] receives
  // silu(gate) * up) or the rotary embedding of a fused QKV weight (rope.heads > 0,
  // launchers.h), the values of the plain product followed by silu_and_mul / rotary_embedding.
  bool silu_and_mul;
  RopeSpec rope;
};

// out = x @ W^T for m <= kQuantGemvMaxRows rows (decode steps), each weight read once for
// all m activation rows. fp8 codes with fp16/bf16 activations, k % 128 == 0 and
// group % 128 == 0 run on tensor cores on sm_80+ (unless tensor_cores is false; at m == 1 only
// for weights of at most 2^24 codes, where they are faster, and never at m == 2): fp16 inputs
// to mma.sync, bf16 activations scaled per 128 inputs by a power of two into fp16's range
// (exact down to 2^-28 of each 128's largest), fp32 sums. int4 codes with fp16/bf16
// activations, k % 256 == 0, group % 128 == 0 and no mins or `zeros` given run on tensor
// cores too (sm_80+, unless tensor_cores is false; at m == 1 only for weights of more than
// 2^24 codes, where they are faster): codes - zeros in the activations' type (exact), fp32
// sums, the scale once per group. Everything else: one warp per weight row on CUDA cores.
// Returns
// cudaErrorInvalidValue for shapes outside the contract above, zeros without mins or with
// other codes than int4, and, where the CUDA-core kernel runs, rows of 2^16 or more 16-byte
// code vectors with more than one group whose (k / kPer) * (group / kPer) reaches 2^32 (k of
// 1.4M+ inputs: the kernel finds a vector's group by a 32-bit multiply-high; the torch op
// refuses those rows whichever kernel would run). With an epilogue (silu_and_mul or
// rope.heads > 0) the CUDA-core kernel runs whatever the tensor-core rules say, and m must be
// 1, the activations fp16 or bf16 and n even (cudaErrorInvalidValue otherwise).
constexpr int kQuantGemvMaxRows = 16;
cudaError_t quant_gemv(const QuantGemvArgs& args, cudaStream_t stream);

// Whether quant_gemv runs a tensor-core kernel for `args` without an epilogue (the rules
// above, on the current device): where it does, an epilogue trades that kernel for the CUDA
// cores' (platforms/cuda/quant.py asks before it fuses).
bool quant_gemv_tensor_cores(const QuantGemvArgs& args);

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

struct Fp8ActivationArgs {
  uint8_t* codes;         // [m_total, k] e4m3 codes, contiguous
  float* scales;          // group == k: [m_total]; group == 128: [k / 128, m_total] (the
                          // outer-dim-major [m_total, k / 128] that torch._scaled_mm takes)
  const void* x;          // [m, k], row stride x_stride elements, rows 16-byte aligned
  int64_t x_stride;
  int m, m_total, k, group;
  DType dtype;
};

// Dynamic FP8 activations for W8A8 GEMMs in one pass: per row (group == k) or per row and
// 128 inputs (group == 128), scale = max(max|x|, 1e-12) * (1 / 448) and code = e4m3(x / scale),
// rounded to nearest even and saturated to +-448: bit for bit what
// platforms/cuda/quant.py's torch ops compute. Rows m .. m_total - 1 are padding: codes 0,
// scale 1e-12 / 448 (what those ops give zero rows). cudaErrorNotSupported where the toolkit
// has no e4m3 conversion (HIP); cudaErrorInvalidValue outside the shapes above (k % 128 == 0
// when group == 128, k % 8 == 0).
cudaError_t quant_fp8_activations(const Fp8ActivationArgs& args, cudaStream_t stream);

}  // namespace core_kernels
