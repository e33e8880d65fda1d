// rope_args.h's checks of the rotary-embedding arguments of the decode GEMV ops.
#include "rope_args.h"

#include <ATen/ATen.h>

namespace core_kernels {
namespace {

std::string dims(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

}  // namespace

RopeSpec checked_rope(const std::string& op, const at::Tensor& x, int64_t rows, const at::Tensor& positions,
                      const at::Tensor& cos_sin, int64_t heads, int64_t head_size, int64_t rotary_dim) {
  TORCH_CHECK(heads >= 1 && head_size >= 2 && head_size % 2 == 0 && rotary_dim >= 2 && rotary_dim % 2 == 0 &&
                  rotary_dim <= head_size && heads * head_size <= rows && rows % 2 == 0,
              op + ": " + std::to_string(heads) + " rotated heads of " + std::to_string(head_size) +
                  " features (rotary_dim " + std::to_string(rotary_dim) + ") do not fit a weight of " +
                  std::to_string(rows) + " rows (need even sizes, rotary_dim <= head_size, an even row count)");
  TORCH_CHECK(positions.is_cuda() && positions.device() == x.device() && positions.scalar_type() == at::kLong &&
                  positions.dim() == 1 && positions.is_contiguous() && positions.size(0) == x.size(0),
              op + ": positions " + dims(positions) + " must be contiguous int64 on x's device, one per row of x " +
                  dims(x));
  TORCH_CHECK(cos_sin.is_cuda() && cos_sin.device() == x.device() && cos_sin.scalar_type() == at::kFloat &&
                  cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.size(1) == rotary_dim,
              op + ": cos_sin " + dims(cos_sin) + " must be a contiguous float32 [positions, rotary_dim " +
                  std::to_string(rotary_dim) + "] table on x's device");
  return RopeSpec{positions.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), static_cast<int>(heads),
                  static_cast<int>(head_size), static_cast<int>(rotary_dim)};
}

}  // namespace core_kernels
