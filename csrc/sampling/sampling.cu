// The fused sampler on the GPU: one block of kSampleThreads threads per row runs
// core_sampling::sample_row (see sample_row.cuh for the algorithm and its semantics).
#include "../cuda_compat.h"
#include "sampling.h"

namespace core_kernels {
namespace {

struct DeviceBlock {
  int tid, n;
  __device__ void sync() { __syncthreads(); }
  __device__ unsigned atomic_add(unsigned* p, unsigned v) { return atomicAdd(p, v); }
  __device__ uint64_t atomic_add(uint64_t* p, uint64_t v) {
    static_assert(sizeof(uint64_t) == sizeof(unsigned long long), "64-bit atomics");
    return atomicAdd(reinterpret_cast<unsigned long long*>(p),
                     static_cast<unsigned long long>(v));
  }
};

// Two blocks per SM: 64 registers per thread at most (checked for spills in tests/compile).
__global__ void __launch_bounds__(kSampleThreads, 2)
    sample_rows_kernel(const core_sampling::SampleArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  DeviceBlock b{static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
  core_sampling::sample_row(b, a, static_cast<int>(blockIdx.x), smem);
}

int chunk_len(int vocab) {
  return ((vocab + kSampleThreads - 1) / kSampleThreads + 3) / 4 * 4;
}

}  // namespace

size_t sample_rows_smem_bytes(int vocab) {
  return core_sampling::Workspace::bytes(kSampleThreads, chunk_len(vocab));
}

cudaError_t sample_rows(const core_sampling::SampleArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  const size_t smem = sample_rows_smem_bytes(args.vocab);
  cudaError_t err = cudaFuncSetAttribute(sample_rows_kernel,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  sample_rows_kernel<<<args.rows, kSampleThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace core_kernels
