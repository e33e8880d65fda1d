// Host entry points of the fused element-wise kernels the model layers call through the
// platform's op table (RMSNorm, residual add + RMSNorm, SiLU-and-mul, rotary embedding).
// Plain C++ over raw pointers like launchers.h: no torch types cross this line.
//
// Every kernel computes what the torch reference in core/ops.py computes, in the same
// order and with the same roundings to the storage dtype, so results agree with the
// reference to float32 rounding (and bit for bit on most elements).
#pragma once

#include <cstdint>

#include "launchers.h"

namespace core_kernels {

// out[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * weight, in float32, rounded once.
// x, out: [rows, hidden] with row strides in elements; weight: [hidden] contiguous, same dtype.
// With residual != nullptr: s = round(x + residual) is written to residual_out and normed
// instead of x (the pre-norm transformer's "add then norm").
struct RmsNormArgs {
  void* out;
  void* residual_out;      // fused variant only, [rows, hidden] contiguous
  const void* x;
  const void* residual;    // nullptr: plain RMSNorm
  const void* weight;
  int64_t x_stride, residual_stride, out_stride;
  int rows, hidden;
  float eps;
  DType dtype;
};
cudaError_t rms_norm(const RmsNormArgs& args, cudaStream_t stream);

// out[r, i] = round(round(silu(x[r, i])) * x[r, d + i]) for i < d: the gate is the first
// half of each row, the up projection the second; out is [rows, d] contiguous.
struct SiluAndMulArgs {
  void* out;
  const void* x;
  int64_t x_stride;
  int rows, d;
  DType dtype;
};
cudaError_t silu_and_mul(const SiluAndMulArgs& args, cudaStream_t stream);

// Neox-style (half-split) rotary embedding of the first rotary_dim features of every query
// and key head; features past rotary_dim are copied. cos_sin: [max_position, rotary_dim]
// float32 (cos half, then sin half). Outputs are contiguous [tokens, heads, head_size].
struct RotaryArgs {
  void* query_out;
  void* key_out;
  const int64_t* positions;  // [tokens]
  const void* query;
  const void* key;
  const float* cos_sin;
  int64_t q_stride_tok, q_stride_head, k_stride_tok, k_stride_head;
  int tokens, num_heads, num_kv_heads, head_size, rotary_dim;
  DType dtype;
};
cudaError_t rotary_embedding(const RotaryArgs& args, cudaStream_t stream);

}  // namespace core_kernels
