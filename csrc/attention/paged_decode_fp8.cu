// Paged decode attention over an FP8 (e4m3) KV cache, for each query/output type (one
// translation unit: the three instantiations compile beside the 16/32-bit ones). Not built for
// ROCm (see CORE_HAS_FP8_KV in cuda_compat.h).
#include "paged_decode.cuh"

namespace core_kernels {

cudaError_t paged_decode_fp8(const DecodeArgs& args, cudaStream_t stream) {
#if CORE_HAS_FP8_KV
  switch (args.dtype) {
    case DType::kFloat16:
      return paged_decode_typed<Fp16, Fp8E4m3>(args, stream);
    case DType::kBFloat16:
      return paged_decode_typed<Bf16, Fp8E4m3>(args, stream);
    case DType::kFloat32:
      return paged_decode_typed<Fp32, Fp8E4m3>(args, stream);
  }
#endif
  (void)args;
  (void)stream;
  return cudaErrorInvalidValue;
}

}  // namespace core_kernels
