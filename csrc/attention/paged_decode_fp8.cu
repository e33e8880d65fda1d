// Paged decode attention over an FP8 (e4m3) KV cache, for each query/output type (one
// translation unit: the three instantiations compile beside the 16/32-bit ones). Head size 128
// with fp16/bf16 queries runs on tensor cores where the device has them (sm_80+,
// paged_decode_fp8_mma.cuh); every other case takes the CUDA-core kernel of paged_decode.cuh.
// Not built for ROCm (see CORE_HAS_FP8_KV in cuda_compat.h).
#include "paged_decode_fp8_mma.cuh"

namespace core_kernels {

cudaError_t paged_decode_fp8(const DecodeArgs& args, cudaStream_t stream) {
#if CORE_HAS_FP8_KV
  const bool mma = args.head_size == Fp8MmaShape::kHead && device_has_mma_f16();
  switch (args.dtype) {
    case DType::kFloat16:
      return mma ? launch_paged_decode_fp8_mma<Fp16>(args, stream) : paged_decode_typed<Fp16, Fp8E4m3>(args, stream);
    case DType::kBFloat16:
      return mma ? launch_paged_decode_fp8_mma<Bf16>(args, stream) : paged_decode_typed<Bf16, Fp8E4m3>(args, stream);
    case DType::kFloat32:  // fp32 queries keep fp32 products (an fp16 q would round them)
      return paged_decode_typed<Fp32, Fp8E4m3>(args, stream);
  }
#endif
  (void)args;
  (void)stream;
  return cudaErrorInvalidValue;
}

}  // namespace core_kernels
