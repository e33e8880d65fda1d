// Host entry point of the skinny decode GEMM (csrc/gemv.cu): plain C++ over raw pointers,
// like launchers.h.
#pragma once

#include <cstdint>

#include "launchers.h"

namespace core_kernels {

constexpr int kGemvMaxRows = 8;
constexpr int kGemvSplitK = 4;  // warps of a CTA that split one row group's inputs (split_k)

// out[m, n] = sum_k x[m, k] * w[n, k], float32 accumulation, one rounding to dtype.
// x: [m, k], w: [n, k], out: [m, n]; last dims contiguous, row strides in elements; x and w
// rows 16-byte aligned and k a multiple of 16 / sizeof(element). 1 <= m <= kGemvMaxRows;
// rows_per_warp in {1, 2, 4} (output features per warp: more rows, fewer and longer warps).
// split_k 1 or kGemvSplitK: the warps of a CTA that share each row's inputs (not with 4 rows per
// warp). silu_and_mul: w is [gate | up] (n even, rows_per_warp 2) and out [m, n / 2] receives
// silu(gate) * up, rounded as this kernel followed by silu_and_mul (fused_ops.h) round it.
struct GemvArgs {
  void* out;
  const void* x;
  const void* w;
  int64_t out_stride, x_stride, w_stride;
  int m, n, k;
  int rows_per_warp;
  int split_k;
  bool silu_and_mul;
  DType dtype;
  // Rotary embedding in the epilogue (rope.heads > 0, launchers.h; rows_per_warp 2, m 1 or 2).
  RopeSpec rope;
  // RMSNorm folded in (norm_w != nullptr; m 1 or 2, rows_per_warp 1 or 2): x is the un-normed
  // input h and the product is of rms_norm(h) with weight norm_w [k] and norm_eps, up to the
  // rounding of the normed input (gemv.cu).
  const void* norm_w;
  float norm_eps;
  // Residual add in the plain epilogue (residual != nullptr, not with norm_w; m 1 or 2): out =
  // round(round(x @ w.T) + residual), residual [m, n] with row stride residual_stride.
  const void* residual;
  int64_t residual_stride;
};
cudaError_t gemv(const GemvArgs& args, cudaStream_t stream);

}  // namespace core_kernels
