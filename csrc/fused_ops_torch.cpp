// Torch registration of the fused element-wise ops (schemas, CUDA and Meta implementations).
// Like the other core_C ops they write into tensors the caller allocates and return nothing,
// so they capture in CUDA graphs and trace under torch.compile. The Python wrappers in
// platforms/cuda/ops.py allocate the outputs and fall back to the torch reference for
// layouts these kernels do not take (rows that are not 16-byte aligned).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "fused_ops.h"

namespace {

using core_kernels::DType;

// Messages are built without iostreams (see the note in ops_cuda.cpp).
std::string shape(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

DType dtype_of(const at::Tensor& t, const char* op) {
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
  TORCH_CHECK(false, std::string("core_C.") + op + ": dtype " + c10::toString(t.scalar_type()) +
                         " is not supported; use float16, bfloat16 or float32");
  return DType::kFloat32;
}

// Rows of `t` (a 2-D view) can be read as 16-byte vectors.
void check_vector_rows(const at::Tensor& t, const at::Tensor& like, const char* what,
                       const char* op) {
  const int64_t vec = 16 / t.element_size();
  TORCH_CHECK(t.is_cuda() && t.device() == like.device() && t.scalar_type() == like.scalar_type(),
              std::string("core_C.") + op + ": " + what + " must be a CUDA tensor of the input's "
                  "dtype on its device");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && t.stride(0) % vec == 0 &&
                  t.size(1) % vec == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              std::string("core_C.") + op + ": " + what + " " + shape(t) +
                  " must be 2-D with contiguous, 16-byte aligned rows whose length is a "
                  "multiple of " + std::to_string(vec) + " elements");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess,
              std::string("core_C.") + op + " failed: " + cudaGetErrorString(err));
}

void norm_impl(at::Tensor& out, at::Tensor* residual_out, const at::Tensor& x,
               const at::Tensor* residual, const at::Tensor& weight, double eps,
               const char* op) {
  check_vector_rows(x, x, "x", op);
  check_vector_rows(out, x, "out", op);
  TORCH_CHECK(out.sizes() == x.sizes(), std::string("core_C.") + op + ": out " + shape(out) +
                                            " must match x " + shape(x));
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device() == x.device(),
              std::string("core_C.") + op + ": weight " + shape(weight) +
                  " must be a contiguous vector of the hidden size in x's dtype");
  core_kernels::RmsNormArgs a{};
  if (residual != nullptr) {
    check_vector_rows(*residual, x, "residual", op);
    check_vector_rows(*residual_out, x, "residual_out", op);
    TORCH_CHECK(residual->sizes() == x.sizes() && residual_out->is_contiguous() &&
                    residual_out->sizes() == x.sizes(),
                std::string("core_C.") + op + ": residual " + shape(*residual) +
                    " and residual_out (contiguous) must match x " + shape(x));
    a.residual = residual->data_ptr();
    a.residual_out = residual_out->data_ptr();
    a.residual_stride = residual->stride(0);
  }
  const c10::cuda::CUDAGuard guard(x.device());
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.weight = weight.data_ptr();
  a.x_stride = x.stride(0);
  a.out_stride = out.stride(0);
  a.rows = static_cast<int>(x.size(0));
  a.hidden = static_cast<int>(x.size(1));
  a.eps = static_cast<float>(eps);
  a.dtype = dtype_of(x, op);
  check_launch(core_kernels::rms_norm(a, c10::cuda::getCurrentCUDAStream()), op);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  norm_impl(out, nullptr, x, nullptr, weight, eps, "rms_norm");
}

void fused_add_rms_norm(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                        const at::Tensor& residual, const at::Tensor& weight, double eps) {
  norm_impl(out, &residual_out, x, &residual, weight, eps, "fused_add_rms_norm");
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  check_vector_rows(x, x, "x", "silu_and_mul");
  check_vector_rows(out, x, "out", "silu_and_mul");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && 2 * out.size(1) == x.size(1),
              "core_C.silu_and_mul: out " + shape(out) + " must be contiguous [rows, d] for x " +
                  shape(x) + " = [rows, 2 * d]");
  const c10::cuda::CUDAGuard guard(x.device());
  core_kernels::SiluAndMulArgs a{};
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.rows = static_cast<int>(x.size(0));
  a.d = static_cast<int>(out.size(1));
  a.dtype = dtype_of(x, "silu_and_mul");
  check_launch(core_kernels::silu_and_mul(a, c10::cuda::getCurrentCUDAStream()), "silu_and_mul");
}

void check_heads(const at::Tensor& t, const at::Tensor& out, const char* what) {
  const int64_t vec = 16 / t.element_size();
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) % vec == 0 &&
                  t.stride(0) % vec == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              std::string("core_C.rotary_embedding: ") + what + " " + shape(t) +
                  " must be [tokens, heads, head_size] with 16-byte aligned heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == t.sizes() &&
                  out.scalar_type() == t.scalar_type() && out.device() == t.device() &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              std::string("core_C.rotary_embedding: the output for ") + what +
                  " must be contiguous and shaped like it, " + shape(t));
}

void rotary_embedding(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
                      const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& cos_sin_cache, int64_t rotary_dim) {
  check_heads(query, query_out, "query");
  check_heads(key, key_out, "key");
  const int64_t vec = 16 / query.element_size();
  const int64_t head = query.size(2);
  TORCH_CHECK(key.size(2) == head && key.size(0) == query.size(0) &&
                  key.scalar_type() == query.scalar_type() && key.device() == query.device(),
              "core_C.rotary_embedding: query " + shape(query) + " and key " + shape(key) +
                  " must share tokens, head size, dtype and device");
  TORCH_CHECK(rotary_dim > 0 && rotary_dim <= head && (rotary_dim / 2) % vec == 0 &&
                  rotary_dim % 2 == 0 && (head - rotary_dim) % vec == 0,
              "core_C.rotary_embedding: rotary_dim " + std::to_string(rotary_dim) +
                  " must be even, at most the head size " + std::to_string(head) +
                  ", with half of it and the unrotated rest multiples of " + std::to_string(vec));
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) == rotary_dim && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.device() == query.device(),
              "core_C.rotary_embedding: cos_sin_cache " + shape(cos_sin_cache) +
                  " must be contiguous float32 [max_position, rotary_dim] on the query's device");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == query.size(0) && positions.is_contiguous() &&
                  positions.device() == query.device(),
              "core_C.rotary_embedding: positions " + shape(positions) +
                  " must be a contiguous int64 vector with one entry per token");
  const c10::cuda::CUDAGuard guard(query.device());
  core_kernels::RotaryArgs a{};
  a.query_out = query_out.data_ptr();
  a.key_out = key_out.data_ptr();
  a.positions = positions.data_ptr<int64_t>();
  a.query = query.data_ptr();
  a.key = key.data_ptr();
  a.cos_sin = cos_sin_cache.data_ptr<float>();
  a.q_stride_tok = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.k_stride_tok = key.stride(0);
  a.k_stride_head = key.stride(1);
  a.tokens = static_cast<int>(query.size(0));
  a.num_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(key.size(1));
  a.head_size = static_cast<int>(head);
  a.rotary_dim = static_cast<int>(rotary_dim);
  a.dtype = dtype_of(query, "rotary_embedding");
  check_launch(core_kernels::rotary_embedding(a, c10::cuda::getCurrentCUDAStream()),
               "rotary_embedding");
}

// ---- Meta: ranks only (sizes may be symbolic under torch.compile) ----------------------------
void rms_norm_meta(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && weight.dim() == 1,
              "rms_norm: expected out/x [rows, hidden] and weight [hidden]");
}

void fused_add_rms_norm_meta(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x,
                             const at::Tensor& residual, const at::Tensor& weight, double) {
  TORCH_CHECK(out.dim() == 2 && residual_out.dim() == 2 && x.dim() == 2 && residual.dim() == 2 &&
                  weight.dim() == 1,
              "fused_add_rms_norm: expected 2-d out/residual_out/x/residual and 1-d weight");
}

void silu_and_mul_meta(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2, "silu_and_mul: expected 2-d out and x");
}

void rotary_embedding_meta(at::Tensor& query_out, at::Tensor& key_out, const at::Tensor& positions,
                           const at::Tensor& query, const at::Tensor& key,
                           const at::Tensor& cos_sin_cache, int64_t) {
  TORCH_CHECK(query_out.dim() == 3 && key_out.dim() == 3 && positions.dim() == 1 &&
                  query.dim() == 3 && key.dim() == 3 && cos_sin_cache.dim() == 2,
              "rotary_embedding: expected 3-d query/key (and outputs), 1-d positions, 2-d cache");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(core_C, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor residual, "
      "Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def(
      "rotary_embedding(Tensor(a!) query_out, Tensor(b!) key_out, Tensor positions, "
      "Tensor query, Tensor key, Tensor cos_sin_cache, int rotary_dim) -> ()");
}

TORCH_LIBRARY_IMPL(core_C, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}

TORCH_LIBRARY_IMPL(core_C, Meta, m) {
  m.impl("rms_norm", &rms_norm_meta);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm_meta);
  m.impl("silu_and_mul", &silu_and_mul_meta);
  m.impl("rotary_embedding", &rotary_embedding_meta);
}
