// Fused element-wise kernels of a decoder layer: RMSNorm (optionally with the residual add),
// SiLU-and-mul and the rotary embedding. Each replaces a chain of 5-20 small torch kernels
// with one pass over the data, which matters most for small decode batches, where a layer
// is dozens of launches of a few microseconds each (see docs/benchmarks/cuda_e2e.md).
//
// All kernels move 16-byte vectors (8 x 16-bit or 4 x fp32); the torch op registration
// (fused_ops_torch.cpp) checks the alignment that needs. Arithmetic is float32 with the
// roundings of the torch reference in core/ops.py (see fused_ops.h).
#include "cuda_compat.h"
#include "dtype_traits.cuh"
#include "fused_ops.h"

namespace core_kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ void load_vec(const void* base, int64_t elem_offset,
                                         float (&f)[T::kVec]) {
  const auto* p = static_cast<const typename T::Storage*>(base) + elem_offset;
  T::to_float(*reinterpret_cast<const uint4*>(p), f);
}

template <typename T>
__device__ __forceinline__ void store_vec(void* base, int64_t elem_offset,
                                          const float (&f)[T::kVec]) {
  auto* p = static_cast<typename T::Storage*>(base) + elem_offset;
  typename T::Storage s[T::kVec];
#pragma unroll
  for (int i = 0; i < T::kVec; ++i) s[i] = T::from_float(f[i]);
  uint4 v;
  __builtin_memcpy(&v, s, sizeof(v));
  *reinterpret_cast<uint4*>(p) = v;
}

// The value a float takes once stored in T (identity for fp32).
template <typename T>
__device__ __forceinline__ void round_vec(float (&f)[T::kVec]) {
  typename T::Storage s[T::kVec];
#pragma unroll
  for (int i = 0; i < T::kVec; ++i) s[i] = T::from_float(f[i]);
  uint4 v;
  __builtin_memcpy(&v, s, sizeof(v));
  T::to_float(v, f);
}

// Sum over the CTA; every thread gets the result. `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int m = kWarpSize / 2; m > 0; m /= 2) v += warp_shfl_xor(v, m);
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  return total;
}

// ---- RMSNorm ---------------------------------------------------------------------------------
// One CTA per row. Rows of at most kVecs vectors per thread stay in registers between the sum of
// squares and the scaling (rms_norm_reg_kernel: one read of the row, the weight read while
// waiting for the previous kernel); longer rows take two passes (rms_norm_kernel: the second
// re-reads the normed input from L1/L2). Both give the same floats: the same sums in the same
// order.
//
// Both run under programmatic dependent launch (launch_dependent): x and residual come from the
// previous kernel and are read only after grid_dependency_wait(); the weight is a parameter no
// kernel writes, so rms_norm_reg_kernel loads it first, overlapping that kernel's tail.
// Vector v of a row as the norm sees it: x, or round(x + residual), which is also stored to
// residual_out (contiguous). Pass 1 of both kernels below.
template <typename T>
__device__ __forceinline__ void normed_input(const RmsNormArgs& a, int row, int v,
                                             float (&x)[T::kVec]) {
  constexpr int V = T::kVec;
  load_vec<T>(a.x, row * a.x_stride + v * V, x);
  if (a.residual != nullptr) {
    float r[V];
    load_vec<T>(a.residual, row * a.residual_stride + v * V, r);
#pragma unroll
    for (int i = 0; i < V; ++i) x[i] += r[i];
    round_vec<T>(x);  // the sum is stored in T, and the norm sees the stored value
    store_vec<T>(a.residual_out, int64_t(row) * a.hidden + v * V, x);
  }
}

template <typename T, int kVecs>
__global__ void __launch_bounds__(kThreads) rms_norm_reg_kernel(const RmsNormArgs a) {
  __shared__ float scratch[kThreads / kWarpSize];
  constexpr int V = T::kVec;
  const int row = blockIdx.x;
  const int vecs = a.hidden / V;
  float w[kVecs][V], x[kVecs][V];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int v = threadIdx.x + i * kThreads;
    if (v < vecs) load_vec<T>(a.weight, v * V, w[i]);
  }
  grid_dependency_wait();
  allow_dependent_launch();
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int v = threadIdx.x + i * kThreads;
    if (v >= vecs) continue;
    normed_input<T>(a, row, v, x[i]);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += x[i][k] * x[i][k];
  }
  const float inv_rms = rsqrtf(block_sum(ss, scratch) * (1.f / a.hidden) + a.eps);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int v = threadIdx.x + i * kThreads;
    if (v >= vecs) continue;
#pragma unroll
    for (int k = 0; k < V; ++k) x[i][k] = (x[i][k] * inv_rms) * w[i][k];
    store_vec<T>(a.out, row * a.out_stride + v * V, x[i]);
  }
}

// Rows longer than 4 vectors per thread. Pass 1 forms the normed input (x, or round(x +
// residual), written to residual_out) and its sum of squares; pass 2 re-reads it and scales.
template <typename T>
__global__ void rms_norm_kernel(const RmsNormArgs a) {
  __shared__ float scratch[kThreads / kWarpSize];
  constexpr int V = T::kVec;
  const int row = blockIdx.x;
  const int vecs = a.hidden / V;
  const bool fused = a.residual != nullptr;
  const int64_t x_row = row * a.x_stride;
  const int64_t s_row = int64_t(row) * a.hidden;  // residual_out is contiguous
  grid_dependency_wait();
  allow_dependent_launch();
  float ss = 0.f;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float x[V];
    normed_input<T>(a, row, v, x);
#pragma unroll
    for (int i = 0; i < V; ++i) ss += x[i] * x[i];
  }
  const float inv_rms = rsqrtf(block_sum(ss, scratch) * (1.f / a.hidden) + a.eps);
  const void* src = fused ? a.residual_out : a.x;
  const int64_t src_row = fused ? s_row : x_row;
  for (int v = threadIdx.x; v < vecs; v += blockDim.x) {
    float x[V], w[V];
    load_vec<T>(src, src_row + v * V, x);
    load_vec<T>(a.weight, v * V, w);
#pragma unroll
    for (int i = 0; i < V; ++i) x[i] = (x[i] * inv_rms) * w[i];
    store_vec<T>(a.out, row * a.out_stride + v * V, x);
  }
}

// ---- SiLU and mul ----------------------------------------------------------------------------
template <typename T>
__global__ void silu_and_mul_kernel(const SiluAndMulArgs a) {
  constexpr int V = T::kVec;
  const int vecs = a.d / V;
  const int64_t total = int64_t(a.rows) * vecs;
  grid_dependency_wait();  // x comes from the previous kernel (launch_dependent)
  allow_dependent_launch();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs;
    const int col = static_cast<int>(i % vecs) * V;
    float g[V], u[V];
    load_vec<T>(a.x, row * a.x_stride + col, g);
    load_vec<T>(a.x, row * a.x_stride + a.d + col, u);
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] = g[k] / (1.f + expf(-g[k]));
    round_vec<T>(g);  // torch rounds silu(gate) to the storage dtype before the product
#pragma unroll
    for (int k = 0; k < V; ++k) g[k] *= u[k];
    store_vec<T>(a.out, row * a.d + col, g);
  }
}

// ---- rotary embedding ------------------------------------------------------------------------
// One CTA per token (the paged decode kernel that follows it overlaps its tail: it waits for
// this kernel only before reading q and the new key); a work item is one 16-byte vector of x1
// (and its partner in x2) of one head, or one vector of the unrotated tail.
template <typename T>
__global__ void rotary_kernel(const RotaryArgs a) {
  constexpr int V = T::kVec;
  const int t = blockIdx.x;
  const int half = a.rotary_dim / 2;
  const int rot_vecs = half / V;
  const int tail_vecs = (a.head_size - a.rotary_dim) / V;
  const int per_head = rot_vecs + tail_vecs;
  const int items = (a.num_heads + a.num_kv_heads) * per_head;
  grid_dependency_wait();  // query and key come from the previous kernel (launch_dependent)
  allow_dependent_launch();
  const float* cs = a.cos_sin + a.positions[t] * a.rotary_dim;
  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    int h = it / per_head;
    const int c = it % per_head;
    const bool is_q = h < a.num_heads;
    if (!is_q) h -= a.num_heads;
    const void* src = is_q ? a.query : a.key;
    void* dst = is_q ? a.query_out : a.key_out;
    const int64_t in = is_q ? t * a.q_stride_tok + h * a.q_stride_head
                            : t * a.k_stride_tok + h * a.k_stride_head;
    const int64_t out = (int64_t(t) * (is_q ? a.num_heads : a.num_kv_heads) + h) * a.head_size;
    if (c >= rot_vecs) {  // features past rotary_dim pass through
      const int off = a.rotary_dim + (c - rot_vecs) * V;
      float x[V];
      load_vec<T>(src, in + off, x);
      store_vec<T>(dst, out + off, x);
      continue;
    }
    const int off = c * V;
    float x1[V], x2[V], o1[V], o2[V];
    load_vec<T>(src, in + off, x1);
    load_vec<T>(src, in + half + off, x2);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float co = cs[off + k], si = cs[half + off + k];
      o1[k] = x1[k] * co - x2[k] * si;
      o2[k] = x2[k] * co + x1[k] * si;
    }
    store_vec<T>(dst, out + off, o1);
    store_vec<T>(dst, out + half + off, o2);
  }
}

int elementwise_blocks(int64_t items) {
  const int64_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

// Every launch is a launch_dependent: each kernel waits for the previous one before reading
// its results, and lets the next one start early (cuda_compat.h).
template <typename T>
cudaError_t launch_rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  const int per_thread = (a.hidden / T::kVec + kThreads - 1) / kThreads;
  if (per_thread <= 1) return launch_dependent(rms_norm_reg_kernel<T, 1>, a.rows, kThreads, 0, stream, a);
  if (per_thread <= 2) return launch_dependent(rms_norm_reg_kernel<T, 2>, a.rows, kThreads, 0, stream, a);
  if (per_thread <= 4) return launch_dependent(rms_norm_reg_kernel<T, 4>, a.rows, kThreads, 0, stream, a);
  return launch_dependent(rms_norm_kernel<T>, a.rows, kThreads, 0, stream, a);
}

template <typename T>
cudaError_t launch_silu_and_mul(const SiluAndMulArgs& a, cudaStream_t stream) {
  const int blocks = elementwise_blocks(int64_t(a.rows) * (a.d / T::kVec));
  return launch_dependent(silu_and_mul_kernel<T>, blocks, kThreads, 0, stream, a);
}

template <typename T>
cudaError_t launch_rotary(const RotaryArgs& a, cudaStream_t stream) {
  return launch_dependent(rotary_kernel<T>, a.tokens, 128, 0, stream, a);
}

}  // namespace

cudaError_t rms_norm(const RmsNormArgs& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kFloat16:
      return launch_rms_norm<Fp16>(a, stream);
    case DType::kBFloat16:
      return launch_rms_norm<Bf16>(a, stream);
    default:
      return launch_rms_norm<Fp32>(a, stream);
  }
}

cudaError_t silu_and_mul(const SiluAndMulArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.d == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kFloat16:
      return launch_silu_and_mul<Fp16>(a, stream);
    case DType::kBFloat16:
      return launch_silu_and_mul<Bf16>(a, stream);
    default:
      return launch_silu_and_mul<Fp32>(a, stream);
  }
}

cudaError_t rotary_embedding(const RotaryArgs& a, cudaStream_t stream) {
  if (a.tokens == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kFloat16:
      return launch_rotary<Fp16>(a, stream);
    case DType::kBFloat16:
      return launch_rotary<Bf16>(a, stream);
    default:
      return launch_rotary<Fp32>(a, stream);
  }
}

}  // namespace core_kernels
