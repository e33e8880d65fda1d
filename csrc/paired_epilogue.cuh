// Epilogues of the decode GEMVs that combine two output rows (csrc/gemv.cu for 16/32-bit
// weights, csrc/quant/quant_gemm.cu for quantized ones): SiLU-and-mul of a merged [gate | up]
// weight, and the rotary embedding of a fused QKV weight. Each kernel sums the two rows of a
// pair as it sums any row; these helpers say which rows pair up and what the pair writes, so
// that both kernels write the values of their plain form followed by silu_and_mul or
// rotary_embedding (csrc/fused_ops.cu), each operand rounded to the storage dtype first.
#pragma once

#include "dtype_traits.cuh"
#include "launchers.h"

namespace core_kernels {

// What a GEMV's epilogue does with the pairs (kPlain: no pairs).
enum PairedEpilogue { kPlain = 0, kSiluMul = 1, kRope = 2 };

// Output pair p's two rows, and the cos/sin index of a rotated pair (-1 for plain rows).
struct RowPair {
  int row0, row1, rope_j;
};

// SiLU-and-mul of a [gate | up] weight of 2 * d rows: gate row p with up row d + p.
__device__ __forceinline__ RowPair silu_pair(int p, int d) { return {p, d + p, -1}; }

// Rotary embedding (n / 2 pairs of a weight of n rows): features j and j + rotary_dim / 2 of
// a rotated head, two consecutive features of a head's unrotated tail, two value features.
__device__ __forceinline__ RowPair rope_pair(int p, const RopeSpec& r) {
  const int half_head = r.head_size / 2;
  if (p >= r.heads * half_head) return {2 * p, 2 * p + 1, -1};  // values
  const int h = p / half_head, j = p - h * half_head, base = h * r.head_size;
  if (j < r.rotary_dim / 2) return {base + j, base + j + r.rotary_dim / 2, j};
  const int row = base + r.rotary_dim + 2 * (j - r.rotary_dim / 2);
  return {row, row + 1, -1};
}

// silu(g) * u as silu_and_mul_kernel computes it from the stored projection.
template <typename T>
__device__ __forceinline__ typename T::Storage silu_mul(float gate, float up) {
  const float g = T::to_float1(T::from_float(gate));
  const float u = T::to_float1(T::from_float(up));
  const float s = T::to_float1(T::from_float(g / (1.f + expf(-g))));
  return T::from_float(s * u);
}

// Writes activation row m's pair (sums s0, s1) into its output row `o`: rotated as
// rotary_kernel rotates the stored projection, or as it is.
template <typename T>
__device__ __forceinline__ void store_rope_pair(typename T::Storage* o, const RowPair& rp, float s0, float s1,
                                                const RopeSpec& r, int m) {
  if (rp.rope_j < 0) {
    o[rp.row0] = T::from_float(s0);
    o[rp.row1] = T::from_float(s1);
    return;
  }
  const float x1 = T::to_float1(T::from_float(s0));
  const float x2 = T::to_float1(T::from_float(s1));
  const float* cs = r.cos_sin + r.positions[m] * r.rotary_dim;
  const float co = cs[rp.rope_j], si = cs[r.rotary_dim / 2 + rp.rope_j];
  o[rp.row0] = T::from_float(x1 * co - x2 * si);
  o[rp.row1] = T::from_float(x2 * co + x1 * si);
}

}  // namespace core_kernels
