// The checks of a decode GEMV op's rotary-embedding arguments, shared by the torch op
// registrations (gemv_torch.cpp, quant/quant_torch.cpp; defined in rope_args.cpp). No torch
// header here: at::Tensor is only declared.
#pragma once

#include <cstdint>
#include <string>

#include "launchers.h"

namespace at {
class Tensor;
}

namespace core_kernels {

// The RopeSpec of `heads` rotated heads of head_size features (rotary_dim of them rotated) for
// a fused QKV weight of `rows` rows and activations x (one position per row of x); a
// TORCH_CHECK error naming `op`, the value and the requirement otherwise.
RopeSpec checked_rope(const std::string& op, const at::Tensor& x, int64_t rows, const at::Tensor& positions,
                      const at::Tensor& cos_sin, int64_t heads, int64_t head_size, int64_t rotary_dim);

}  // namespace core_kernels
