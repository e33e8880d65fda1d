// The fused sampler on the GPU: one block of kSampleThreads threads per row, or `splits` of them
// (rows split across blocks: small batches), runs core_sampling::sample_row (see sample_row.cuh
// for the algorithm and its semantics).
#include "../cuda_compat.h"
#include "sampling.h"

#include <cstdint>

namespace core_kernels {
namespace {

struct DeviceBlock {
  int tid, n;
  __device__ void sync() { __syncthreads(); }
  __device__ void fence() { __threadfence(); }
  // Another block's store, read from L2 (a stale L1 line could hold an older value).
  template <class T>
  __device__ T load_fresh(const T* p) {
    static_assert(sizeof(T) % 8 == 0 && alignof(T) >= 8, "8-byte words");
    unsigned long long words[sizeof(T) / 8];
    const auto* src = reinterpret_cast<const unsigned long long*>(p);
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(T) / 8); ++i) words[i] = load_cg(src + i);
    T out;
    memcpy(&out, words, sizeof(T));
    return out;
  }
  __device__ unsigned atomic_add(unsigned* p, unsigned v) { return atomicAdd(p, v); }
  __device__ uint64_t atomic_add(uint64_t* p, uint64_t v) {
    static_assert(sizeof(uint64_t) == sizeof(unsigned long long), "64-bit atomics");
    return atomicAdd(reinterpret_cast<unsigned long long*>(p),
                     static_cast<unsigned long long>(v));
  }
};

// Two blocks per SM: 64 registers per thread at most (checked for spills in tests/compile).
// One block per row.
__global__ void __launch_bounds__(kSampleThreads, 2)
    sample_rows_kernel(const core_sampling::SampleArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  DeviceBlock b{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
  core_sampling::sample_row<false>(b, a, static_cast<int>(blockIdx.x), smem, 0);
}

#ifndef USE_ROCM
// a.splits blocks per row: block x is block x % splits of row x / splits. Launched for small
// batches (platforms/cuda/sampling.py: at most one block per SM), so it may take twice the
// registers (the split path and the whole-row path of unsplittable rows, in one kernel).
__global__ void __launch_bounds__(kSampleThreads, 1)
    sample_split_rows_kernel(const core_sampling::SampleArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  DeviceBlock b{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
  const int x = static_cast<int>(blockIdx.x);
  core_sampling::sample_row<true>(b, a, x / a.splits, smem, x % a.splits);
}
#endif  // Not built for HIP: the ROCm platform does not use the fused sampler (its op table is
        // core's torch ops), and on CDNA this kernel spills 22 SGPRs (tests/compile).

int chunk_len(int vocab) {
  return ((vocab + kSampleThreads - 1) / kSampleThreads + 3) / 4 * 4;
}

}  // namespace

size_t sample_rows_smem_bytes(int vocab) {
  return core_sampling::Workspace::bytes(kSampleThreads, chunk_len(vocab));
}

cudaError_t sample_rows(const core_sampling::SampleArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  if (args.splits < 1 || args.splits > kSampleThreads ||
      (args.splits > 1 && (args.part == nullptr || args.arrivals == nullptr)) ||
      static_cast<int64_t>(args.rows) * args.splits > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  const size_t smem = sample_rows_smem_bytes(args.vocab);
#ifdef USE_ROCM
  if (args.splits > 1) return cudaErrorInvalidValue;  // no split kernel on ROCm (above)
  const auto kernel = sample_rows_kernel;
#else
  const auto kernel = args.splits > 1 ? sample_split_rows_kernel : sample_rows_kernel;
#endif
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<args.rows * args.splits, kSampleThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace core_kernels
