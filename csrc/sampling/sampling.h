// Host entry point of the fused sampler (csrc/sampling/sample_row.cuh): one block per row.
// Plain C++ over raw pointers like launchers.h: no torch types cross this line.
#pragma once

#include <cstddef>

#include "../launchers.h"  // the runtime API (cudaError_t, cudaStream_t), CUDA or HIP
#include "sample_row.cuh"

namespace core_kernels {

constexpr int kSampleThreads = 512;
// Bytes of dynamic shared memory one row's block needs for a vocabulary of `vocab` tokens.
size_t sample_rows_smem_bytes(int vocab);
// Launches the sampler over args.rows rows on `stream`; returns the launch error.
cudaError_t sample_rows(const core_sampling::SampleArgs& args, cudaStream_t stream);

}  // namespace core_kernels
