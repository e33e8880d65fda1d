// Torch registration of the skinny decode GEMM (csrc/gemv.cu). Like the other core_C ops it
// writes into a tensor the caller allocates and returns nothing, so it captures in CUDA graphs.
// platforms/cuda/gemv.py decides when to call it (few rows, aligned layouts) and falls back to
// torch's linear otherwise.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>

#include "gemv.h"
#include "rope_args.h"

namespace {

using core_kernels::DType;

std::string dims(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

DType gemv_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    default:
      break;
  }
  TORCH_CHECK(false, "core_C.gemv: dtype " + std::string(c10::toString(t.scalar_type())) +
                         " is not supported; use float16, bfloat16 or float32");
  return DType::kFloat32;
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* what, bool vector_rows) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device() && t.scalar_type() == like.scalar_type(),
              std::string("core_C.gemv: ") + what + " must be a CUDA tensor of x's dtype on its device");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1,
              std::string("core_C.gemv: ") + what + " " + dims(t) + " must be 2-D with a contiguous last dim");
  if (vector_rows) {
    const int64_t vec = 16 / t.element_size();
    TORCH_CHECK(t.stride(0) % vec == 0 && t.size(1) % vec == 0 &&
                    reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                std::string("core_C.gemv: ") + what + " " + dims(t) +
                    " needs 16-byte aligned rows whose length is a multiple of " +
                    std::to_string(vec) + " elements");
  }
}

// Checks the operands and fills the launch's arguments (no rotary embedding).
core_kernels::GemvArgs gemv_args(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t rows_per_warp,
                                 int64_t split_k, bool silu_and_mul) {
  check_rows(x, x, "x", true);
  check_rows(weight, x, "weight", true);
  check_rows(out, x, "out", false);
  const int64_t n_out = silu_and_mul ? weight.size(0) / 2 : weight.size(0);
  TORCH_CHECK(!silu_and_mul || weight.size(0) % 2 == 0,
              "core_C.gemv: silu_and_mul needs a [gate | up] weight of an even number of rows, got " + dims(weight));
  TORCH_CHECK(x.size(1) == weight.size(1) && out.size(0) == x.size(0) && out.size(1) == n_out,
              "core_C.gemv: shapes do not match: x " + dims(x) + ", weight " + dims(weight) + ", out " + dims(out) +
                  (silu_and_mul ? " (want out [m, n / 2] for x [m, k] and a [gate | up] weight [n, k])"
                                : " (want out [m, n] for x [m, k] and weight [n, k])"));
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= core_kernels::kGemvMaxRows,
              "core_C.gemv: x has " + std::to_string(x.size(0)) + " rows; the kernel takes 1 to " +
                  std::to_string(core_kernels::kGemvMaxRows) + " (use torch's linear above that)");
  TORCH_CHECK(rows_per_warp == 1 || rows_per_warp == 2 || rows_per_warp == 4,
              "core_C.gemv: rows_per_warp " + std::to_string(rows_per_warp) + " must be 1, 2 or 4");
  TORCH_CHECK(split_k == 1 || (split_k == core_kernels::kGemvSplitK && rows_per_warp != 4),
              "core_C.gemv: split_k " + std::to_string(split_k) + " must be 1 or " +
                  std::to_string(core_kernels::kGemvSplitK) + " (" + std::to_string(core_kernels::kGemvSplitK) +
                  " only with 1 or 2 rows per warp)");
  TORCH_CHECK(!silu_and_mul || rows_per_warp == 2,
              "core_C.gemv: silu_and_mul takes rows_per_warp 2 (one gate and one up row), got " +
                  std::to_string(rows_per_warp));
  core_kernels::GemvArgs a{};
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.w = weight.data_ptr();
  a.out_stride = out.stride(0);
  a.x_stride = x.stride(0);
  a.w_stride = weight.stride(0);
  a.m = static_cast<int>(x.size(0));
  a.n = static_cast<int>(weight.size(0));
  a.k = static_cast<int>(x.size(1));
  a.rows_per_warp = static_cast<int>(rows_per_warp);
  a.split_k = static_cast<int>(split_k);
  a.silu_and_mul = silu_and_mul;
  a.dtype = gemv_dtype(x);
  return a;
}

// The RMSNorm weight folded into the product (x then holds the un-normed rows): one or two rows
// of x, a contiguous [k] vector of x's dtype.
void set_norm(core_kernels::GemvArgs& a, const char* op, const at::Tensor& x, const std::optional<at::Tensor>& norm_weight,
              double norm_eps) {
  if (!norm_weight.has_value()) return;
  const at::Tensor& g = *norm_weight;
  TORCH_CHECK(a.rows_per_warp == 1 || a.rows_per_warp == 2,
              std::string(op) + ": the folded RMSNorm takes rows_per_warp 1 or 2, got " + std::to_string(a.rows_per_warp));
  TORCH_CHECK(x.size(0) <= 2, std::string(op) + ": x has " + std::to_string(x.size(0)) +
                                  " rows; the folded RMSNorm takes 1 or 2 (use rms_norm, then the GEMV)");
  TORCH_CHECK(g.is_cuda() && g.device() == x.device() && g.scalar_type() == x.scalar_type() && g.dim() == 1 &&
                  g.size(0) == x.size(1) && g.is_contiguous() && reinterpret_cast<uintptr_t>(g.data_ptr()) % 16 == 0,
              std::string(op) + ": norm_weight " + dims(g) + " must be a contiguous, 16-byte aligned CUDA vector of " +
                  std::to_string(x.size(1)) + " elements of x's dtype on its device");
  TORCH_CHECK(norm_eps >= 0.0, std::string(op) + ": norm_eps " + std::to_string(norm_eps) + " must be >= 0");
  a.norm_w = g.data_ptr();
  a.norm_eps = static_cast<float>(norm_eps);
}

void gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t rows_per_warp, int64_t split_k,
          bool silu_and_mul, const std::optional<at::Tensor>& norm_weight, double norm_eps,
          const std::optional<at::Tensor>& residual) {
  core_kernels::GemvArgs a = gemv_args(out, x, weight, rows_per_warp, split_k, silu_and_mul);
  set_norm(a, "core_C.gemv", x, norm_weight, norm_eps);
  if (residual.has_value()) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(!silu_and_mul && !norm_weight.has_value(),
                "core_C.gemv: residual is added by the plain epilogue only, not with silu_and_mul or norm_weight");
    TORCH_CHECK(x.size(0) <= 2, "core_C.gemv: x has " + std::to_string(x.size(0)) +
                                    " rows; the residual add takes 1 or 2 (add after the GEMV)");
    TORCH_CHECK(rows_per_warp == 1 || rows_per_warp == 2,
                "core_C.gemv: the residual add takes rows_per_warp 1 or 2, got " + std::to_string(rows_per_warp));
    check_rows(r, x, "residual", false);
    TORCH_CHECK(r.size(0) == out.size(0) && r.size(1) == out.size(1),
                "core_C.gemv: residual " + dims(r) + " must have out's shape " + dims(out));
    a.residual = r.data_ptr();
    a.residual_stride = r.stride(0);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = core_kernels::gemv(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, std::string("core_C.gemv failed: ") + cudaGetErrorString(err));
}

// out = x @ weight.T with the first rope_heads heads of head_size features rotated by
// cos_sin[positions] (rotary_dim features a head), as rotary_embedding rotates them.
void gemv_rope(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t split_k,
               const at::Tensor& positions, const at::Tensor& cos_sin, int64_t rope_heads, int64_t head_size,
               int64_t rotary_dim, const std::optional<at::Tensor>& norm_weight, double norm_eps) {
  TORCH_CHECK(x.size(0) <= 2, "core_C.gemv_rope: x has " + std::to_string(x.size(0)) +
                                  " rows; the rotating epilogue takes 1 or 2 (use gemv, then rotary_embedding)");
  core_kernels::GemvArgs a = gemv_args(out, x, weight, 2, split_k, false);
  a.rope = core_kernels::checked_rope("core_C.gemv_rope", x, weight.size(0), positions, cos_sin, rope_heads, head_size,
                                      rotary_dim);
  set_norm(a, "core_C.gemv_rope", x, norm_weight, norm_eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = core_kernels::gemv(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, std::string("core_C.gemv_rope failed: ") + cudaGetErrorString(err));
}

void gemv_rope_meta(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                    int64_t, int64_t, int64_t, const std::optional<at::Tensor>&, double) {}

void gemv_meta(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, int64_t, int64_t, bool,
               const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && weight.dim() == 2, "gemv: expected 2-d out, x, weight");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(core_C, m) {
  m.def(
      "gemv(Tensor(a!) out, Tensor x, Tensor weight, int rows_per_warp, int split_k=1, bool silu_and_mul=False, "
      "Tensor? norm_weight=None, float norm_eps=0.0, Tensor? residual=None) -> ()");
}

TORCH_LIBRARY_FRAGMENT(core_C, m) {
  m.def(
      "gemv_rope(Tensor(a!) out, Tensor x, Tensor weight, int split_k, Tensor positions, Tensor cos_sin, "
      "int rope_heads, int head_size, int rotary_dim, Tensor? norm_weight=None, float norm_eps=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(core_C, CUDA, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_rope", &gemv_rope);
}

TORCH_LIBRARY_IMPL(core_C, Meta, m) {
  m.impl("gemv", &gemv_meta);
  m.impl("gemv_rope", &gemv_rope_meta);
}
