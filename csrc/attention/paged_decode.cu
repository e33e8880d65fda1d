// Element-type dispatch of paged decode attention; the kernels live in paged_decode.cuh.
#include "../launchers.h"

namespace core_kernels {

cudaError_t paged_decode(const DecodeArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  if (args.num_kv_heads <= 0 || args.num_q_heads % args.num_kv_heads != 0 || args.block_size < 16 ||
      args.block_size != (1 << args.block_shift) || args.num_seqs > 65535 ||
      (args.partition % 16) != 0) {
    return cudaErrorInvalidValue;
  }
  if (args.kv_fp8) return paged_decode_fp8(args, stream);
  switch (args.dtype) {
    case DType::kFloat16:
      return paged_decode_fp16(args, stream);
    case DType::kBFloat16:
      return paged_decode_bf16(args, stream);
    case DType::kFloat32:
      return paged_decode_fp32(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace core_kernels
