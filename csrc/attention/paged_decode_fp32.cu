// Paged decode attention instantiated for one element type (one translation unit per type so
// the build compiles them in parallel).
#include "paged_decode.cuh"

namespace core_kernels {

cudaError_t paged_decode_fp32(const DecodeArgs& args, cudaStream_t stream) {
  return paged_decode_typed<Fp32, Fp32>(args, stream);
}

}  // namespace core_kernels
