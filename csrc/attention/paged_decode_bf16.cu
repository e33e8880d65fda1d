// Paged decode attention instantiated for one element type (one translation unit per type so
// the build compiles them in parallel).
#include "paged_decode.cuh"

namespace core_kernels {

cudaError_t paged_decode_bf16(const DecodeArgs& args, cudaStream_t stream) {
  return paged_decode_typed<Bf16, Bf16>(args, stream);
}

}  // namespace core_kernels
