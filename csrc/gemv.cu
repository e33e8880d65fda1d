// Skinny GEMM for decode steps: out[m, n] = sum_k x[m, k] * w[n, k] for M <= 8
// rows of x. At batch 1-8 a linear layer reads its whole weight for a handful of rows, so it is
// bound by memory bandwidth, and cuBLAS's tiles (built for large M) leave a third of the H200's
// bandwidth unused on the narrow projections (Llama-3-8B's fused QKV: 3.3 TB/s, the output
// projection: 2.7 TB/s; docs/benchmarks/cuda_gemv.md).
//
// Layout: one warp owns kRows consecutive output features. Its lanes stream those weight rows
// in 16-byte vectors (kUnroll vectors per row in flight per lane, so enough bytes are
// outstanding per SM to cover HBM latency) and multiply them by the same 8 elements of every
// row of x, read through the read-only cache (x is a few KiB, shared by every warp). Each lane
// accumulates kRows x M float32 partial sums; a butterfly over the warp finishes them, and lane
// 0 writes the outputs, rounded once to the storage dtype. Float32 accumulation in a
// different order from cuBLAS: results agree to rounding, not bit for bit. Variants (see
// gemv_kernel): a CTA's warps splitting long rows' inputs (the 14,336-input down projection);
// SiLU-and-mul of a merged [gate | up] weight or the rotary embedding of a fused QKV weight in
// the epilogue; the residual add of a decoder layer in the epilogue; and the RMSNorm of the
// input folded in (kNorm), which removes a decode step's norm kernels (see gemv_kernel).
#include "cuda_compat.h"
#include "dtype_traits.cuh"
#include "gemv.h"
#include "paired_epilogue.cuh"

namespace core_kernels {
namespace {

constexpr int kWarps = kGemvSplitK;  // per CTA (a split CTA's warps are all one row group)
constexpr int kUnroll = 2;

template <typename T>
__device__ __forceinline__ uint4 load_ro(const typename T::Storage* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// kSplit: warps of a CTA that share one group of rows (1, or kWarps, the default: each warp
// sums every kSplit-th warp-wide slice of k and warp 0 adds the kSplit partial sums in a fixed
// order, so a CTA streams several slices of the same rows at once and the grid has kSplit times
// more CTAs). kEpi, what the epilogue does with a warp's two rows (kRows 2) when not kPlain:
// kSiluMul, the weight is [gate | up] (n = 2d rows) and a warp takes gate row j with up row
// d + j, writing round(round(silu(round(g))) * round(u)) to out[m, j]: the values of this
// kernel followed by silu_and_mul (csrc/fused_ops.cu), without the second kernel. kRope, the
// weight is a fused QKV projection and a warp takes features j and j + rotary_dim / 2 of one
// query or key head, rotating them as rotary_kernel does (or two unrotated features); the
// pairing and the two epilogues are paired_epilogue.cuh's, shared with the quantized GEMV.
//
// kFuse & kFoldNorm: x holds un-normed rows h (a decoder layer's residual stream) and the product is of
// rms_norm(h) * gamma (a.norm_w): each lane multiplies its elements of h by gamma and also sums
// their squares, which are reduced with the products, and the sums are scaled by
// rsqrt(mean square + eps) before the epilogue. No CTA waits for a norm: the norm kernel that
// would run before this one is gone. The values differ from rms_norm followed by this kernel
// by the rounding of the normed input to the storage dtype (which the product skips).
// kFuse & kAddResidual (plain epilogue only): each output is round(round(sum) + residual), the
// residual add that fused_add_rms_norm would do next (a.residual).

// What a launch folds in besides its epilogue (a bit mask, see below).
enum GemvFusion { kFoldNorm = 1, kAddResidual = 2 };

template <typename T, int M, int kRows, int kSplit, int kEpi, int kFuse>
__global__ void __launch_bounds__(kWarps* kWarpSize) gemv_kernel(const GemvArgs a, const int prefetch_lines) {
  constexpr bool kGated = kEpi == kSiluMul;
  constexpr bool kPaired = kEpi != kPlain;  // a warp's two rows are one output pair
  constexpr bool kNorm = (kFuse & kFoldNorm) != 0;
  static_assert(!(kFuse & kAddResidual) || kEpi == kPlain, "the residual is added by the plain epilogue");
  static_assert(kSplit == 1 || kSplit == kWarps, "a CTA's warps are one row group or kWarps of them");
  static_assert(!kPaired || kRows == 2, "the paired epilogues take two rows a warp");
  using S = typename T::Storage;
  constexpr int V = T::kVec;
  const int lane = threadIdx.x % kWarpSize;
  const int wid = threadIdx.x / kWarpSize;
  const int slice = wid % kSplit;
  const int group = blockIdx.x * (kWarps / kSplit) + wid / kSplit;
  const int n_out = kPaired ? a.n / 2 : a.n;  // kRope: pairs of rows
  const int n0 = kPaired ? group : group * kRows;
  if (n0 >= n_out) return;  // whole warps (whole CTAs when split): the shuffles need every lane
  const S* w = static_cast<const S*>(a.w);
  const S* x = static_cast<const S*>(a.x);
  int rows[kRows];
  RowPair pair{};  // the paired epilogues' rows (paired_epilogue.cuh)
  if constexpr (kPaired) {
    pair = kGated ? silu_pair(n0, n_out) : rope_pair(n0, a.rope);
    rows[0] = pair.row0;
    rows[1] = pair.row1;
  } else {
#pragma unroll
    for (int r = 0; r < kRows; ++r) rows[r] = min(n0 + r, a.n - 1);  // tail rows recompute n-1
  }

  // Row kRows of acc: with kNorm, the sum of squares of each row of x.
  constexpr int kAcc = kRows + (kNorm ? 1 : 0);
  float acc[kAcc][M];
#pragma unroll
  for (int r = 0; r < kAcc; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  const S* gamma = static_cast<const S*>(a.norm_w);

  constexpr int kStep = kWarpSize * V;  // elements one pass of the warp covers
  constexpr int kStride = kStep * kSplit;  // between one warp's consecutive passes
  // Launched with launch_dependent: x comes from the kernel before, which may still be
  // running; the weights do not, so their rows' starts go to L2 first (cuda_compat.h).
  if (slice == 0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) prefetch_row_start(w + int64_t(rows[r]) * a.w_stride, prefetch_lines, lane);
  }
  grid_dependency_wait();
  for (int k0 = slice * kStep + lane * V; k0 < a.k; k0 += kStride * kUnroll) {
    uint4 wv[kUnroll][kRows];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * kStride;
      const int kk = k < a.k ? k : 0;  // past the end: a harmless load, its sums skipped
#pragma unroll
      for (int r = 0; r < kRows; ++r) wv[u][r] = load_ro<T>(w + int64_t(rows[r]) * a.w_stride + kk);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k = k0 + u * kStride;
      if (k >= a.k) continue;
      float gf[V];
      if constexpr (kNorm) T::to_float(load_ro<T>(gamma + k), gf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[V];
        T::to_float(load_ro<T>(x + int64_t(m) * a.x_stride + k), xf);
        if constexpr (kNorm) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            acc[kRows][m] = fmaf(xf[i], xf[i], acc[kRows][m]);
            xf[i] *= gf[i];
          }
        }
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          float wf[V];
          T::to_float(wv[u][r], wf);
#pragma unroll
          for (int i = 0; i < V; ++i) acc[r][m] = fmaf(xf[i], wf[i], acc[r][m]);
        }
      }
    }
  }

  allow_dependent_launch();  // every weight is read: the next kernel may be scheduled
#pragma unroll
  for (int r = 0; r < kAcc; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int s = kWarpSize / 2; s > 0; s /= 2) acc[r][m] += warp_shfl_xor(acc[r][m], s);

  if constexpr (kSplit > 1) {
    __shared__ float part[kSplit][kAcc][M];
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kAcc; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) part[slice][r][m] = acc[r][m];
    }
    __syncthreads();
    if (slice != 0) return;
#pragma unroll
    for (int r = 0; r < kAcc; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float sum = part[0][r][m];
#pragma unroll
        for (int s = 1; s < kSplit; ++s) sum += part[s][r][m];
        acc[r][m] = sum;
      }
  }

  if (lane != 0) return;
  if constexpr (kNorm) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const float inv_rms = rsqrtf(acc[kRows][m] * (1.f / a.k) + a.norm_eps);
#pragma unroll
      for (int r = 0; r < kRows; ++r) acc[r][m] *= inv_rms;
    }
  }
  S* out = static_cast<S*>(a.out);
  if constexpr (kEpi == kRope) {
#pragma unroll
    for (int m = 0; m < M; ++m) store_rope_pair<T>(out + int64_t(m) * a.out_stride, pair, acc[0][m], acc[1][m], a.rope, m);
  } else if constexpr (kGated) {
#pragma unroll
    for (int m = 0; m < M; ++m) out[int64_t(m) * a.out_stride + n0] = silu_mul<T>(acc[0][m], acc[1][m]);
  } else {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int n = n0 + r;
      if (n >= a.n) break;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        S v = T::from_float(acc[r][m]);
        if constexpr ((kFuse & kAddResidual) != 0) {
          const S* res = static_cast<const S*>(a.residual) + int64_t(m) * a.residual_stride + n;
          v = T::from_float(T::to_float1(v) + T::to_float1(*res));
        }
        out[int64_t(m) * a.out_stride + n] = v;
      }
    }
  }
}

template <typename T, int M, int kRows, int kSplit, int kEpi, int kFuse = 0>
cudaError_t launch(const GemvArgs& a, cudaStream_t stream) {
  const int groups = kEpi != kPlain ? a.n / 2 : (a.n + kRows - 1) / kRows;
  constexpr int kGroupsPerCta = kWarps / kSplit;
  const int blocks = (groups + kGroupsPerCta - 1) / kGroupsPerCta;
  // Under programmatic dependent launch (cuda_compat.h): the CTAs are resident while the
  // kernel before (the norm, SiLU-and-mul, the attention's reduce) finishes.
  const int lines = prefetch_lines_per_row(a.n, int64_t(a.k) * sizeof(typename T::Storage));
  return launch_dependent(gemv_kernel<T, M, kRows, kSplit, kEpi, kFuse>, dim3(blocks), dim3(kWarps * kWarpSize), 0,
                          stream, a, lines);
}

template <typename T, int kRows, int kSplit, int kEpi>
cudaError_t dispatch_m(const GemvArgs& a, cudaStream_t stream) {
  switch (a.m) {
    case 1: return launch<T, 1, kRows, kSplit, kEpi>(a, stream);
    case 2: return launch<T, 2, kRows, kSplit, kEpi>(a, stream);
    case 3: return launch<T, 3, kRows, kSplit, kEpi>(a, stream);
    case 4: return launch<T, 4, kRows, kSplit, kEpi>(a, stream);
    case 5: return launch<T, 5, kRows, kSplit, kEpi>(a, stream);
    case 6: return launch<T, 6, kRows, kSplit, kEpi>(a, stream);
    case 7: return launch<T, 7, kRows, kSplit, kEpi>(a, stream);
    case 8: return launch<T, 8, kRows, kSplit, kEpi>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The fused forms (kFuse), for the decode steps the dense method sends (one or two rows, one
// or two rows a warp): the folded norm with each epilogue, the residual add with the plain one.
template <typename T, int M, int kFuse>
cudaError_t dispatch_fused_m(const GemvArgs& a, cudaStream_t stream) {
  const bool split = a.split_k != 1;
  if constexpr ((kFuse & kAddResidual) == 0) {
    if (a.silu_and_mul) return split ? launch<T, M, 2, kWarps, kSiluMul, kFuse>(a, stream) : launch<T, M, 2, 1, kSiluMul, kFuse>(a, stream);
    if (a.rope.heads > 0) return split ? launch<T, M, 2, kWarps, kRope, kFuse>(a, stream) : launch<T, M, 2, 1, kRope, kFuse>(a, stream);
  }
  if (a.rows_per_warp == 1) return split ? launch<T, M, 1, kWarps, kPlain, kFuse>(a, stream) : launch<T, M, 1, 1, kPlain, kFuse>(a, stream);
  return split ? launch<T, M, 2, kWarps, kPlain, kFuse>(a, stream) : launch<T, M, 2, 1, kPlain, kFuse>(a, stream);
}

template <typename T, int kFuse>
cudaError_t dispatch_fused(const GemvArgs& a, cudaStream_t stream) {
  const bool paired = a.silu_and_mul || a.rope.heads > 0;
  if (a.m > 2 || (a.rows_per_warp != 1 && a.rows_per_warp != 2) || (paired && (kFuse & kAddResidual)) ||
      (paired && (a.n % 2 != 0 || a.rows_per_warp != 2)) || (a.silu_and_mul && a.rope.heads > 0) ||
      (a.rope.heads > 0 && !rope_spec_fits(a.rope, a.n))) {
    return cudaErrorInvalidValue;
  }
  return a.m == 1 ? dispatch_fused_m<T, 1, kFuse>(a, stream) : dispatch_fused_m<T, 2, kFuse>(a, stream);
}

template <typename T>
cudaError_t dispatch_rows(const GemvArgs& a, cudaStream_t stream) {
  const bool split = a.split_k != 1;
  if (a.norm_w != nullptr && a.residual != nullptr) return cudaErrorInvalidValue;  // one or the other
  if (a.norm_w != nullptr) return dispatch_fused<T, kFoldNorm>(a, stream);
  if (a.residual != nullptr) return dispatch_fused<T, kAddResidual>(a, stream);
  if (a.silu_and_mul || a.rope.heads > 0) {  // pairs of rows: two per warp
    if (a.n % 2 != 0 || a.rows_per_warp != 2 || (a.silu_and_mul && a.rope.heads > 0)) return cudaErrorInvalidValue;
    if (a.silu_and_mul) return split ? dispatch_m<T, 2, kWarps, kSiluMul>(a, stream) : dispatch_m<T, 2, 1, kSiluMul>(a, stream);
    if (!rope_spec_fits(a.rope, a.n)) return cudaErrorInvalidValue;
    // One or two rows (the decode steps the dense method sends; more rows spilled registers).
    switch (a.m) {
      case 1: return split ? launch<T, 1, 2, kWarps, kRope>(a, stream) : launch<T, 1, 2, 1, kRope>(a, stream);
      case 2: return split ? launch<T, 2, 2, kWarps, kRope>(a, stream) : launch<T, 2, 2, 1, kRope>(a, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  switch (a.rows_per_warp) {
    case 1: return split ? dispatch_m<T, 1, kWarps, kPlain>(a, stream) : dispatch_m<T, 1, 1, kPlain>(a, stream);
    case 2: return split ? dispatch_m<T, 2, kWarps, kPlain>(a, stream) : dispatch_m<T, 2, 1, kPlain>(a, stream);
    case 4: return split ? cudaErrorInvalidValue : dispatch_m<T, 4, 1, kPlain>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t gemv(const GemvArgs& a, cudaStream_t stream) {
  if (a.m < 1 || a.m > kGemvMaxRows || a.n < 1 || a.k < 1) return cudaErrorInvalidValue;
  if (a.split_k != 1 && a.split_k != kGemvSplitK) return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat16: return dispatch_rows<Fp16>(a, stream);
    case DType::kBFloat16: return dispatch_rows<Bf16>(a, stream);
    case DType::kFloat32: return dispatch_rows<Fp32>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace core_kernels
