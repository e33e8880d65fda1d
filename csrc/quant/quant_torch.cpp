// Torch registration of the weight-only quantized linear ops (schemas, CUDA and Meta
// implementations). Like the other core_C ops they write into tensors the caller allocates
// and return nothing, so they capture in CUDA graphs. platforms/cuda/quant.py packs the
// weights and calls them.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "../rope_args.h"
#include "quant_gemm.h"

namespace {

using core_kernels::DType;
using core_kernels::QuantCode;

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
  TORCH_CHECK(false, std::string("core_C.") + op + ": activations of dtype " +
                         c10::toString(t.scalar_type()) + " are not supported; use float16, "
                         "bfloat16 or float32");
  return DType::kFloat32;
}

QuantCode code_of(int64_t code, const char* op) {
  TORCH_CHECK(code >= 0 && code <= 2, std::string("core_C.") + op + ": code " +
                                          std::to_string(code) + " must be 0 (int4), 1 (int8) or 2 (fp8)");
  return static_cast<QuantCode>(code);
}

// Checks the packed weight of quant_gemm.h and returns k (inputs per row).
int64_t check_weight(const at::Tensor& codes, const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                     QuantCode code, int64_t group, const char* op) {
  const std::string where = std::string("core_C.") + op + ": ";
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 2 && codes.is_contiguous() && codes.element_size() == 1,
              where + "codes " + shape(codes) + " must be a contiguous 2-D CUDA tensor of bytes");
  const int64_t k = codes.size(1) * (code == QuantCode::kInt4 ? 2 : 1);
  TORCH_CHECK(group > 0 && k % group == 0 && k % 32 == 0 &&
                  group % (code == QuantCode::kInt4 ? 32 : 16) == 0,
              where + "group " + std::to_string(group) + " must divide k " + std::to_string(k) +
                  " (a multiple of 32) and span whole 16-byte code vectors");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == k / group &&
                  scales.device() == codes.device(),
              where + "scales " + shape(scales) + " must be contiguous float32 [" +
                  std::to_string(codes.size(0)) + ", " + std::to_string(k / group) + "]");
  if (mins.has_value()) {
    TORCH_CHECK(mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes() &&
                    mins->device() == codes.device(),
                where + "mins " + shape(*mins) + " must be contiguous float32 like scales " + shape(scales));
  }
  return k;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, std::string("core_C.") + op + " failed: " + cudaGetErrorString(err));
}

// Checks quant_gemv's operands and fills its launch arguments; out has out_cols columns (the
// weight's rows, or half of them for SiLU-and-mul).
core_kernels::QuantGemvArgs quant_gemv_args(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                                            const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                            int64_t code, int64_t group, bool tensor_cores,
                                            const c10::optional<at::Tensor>& zeros, int64_t out_cols) {
  const QuantCode c = code_of(code, "quant_gemv");
  const int64_t k = check_weight(codes, scales, mins, c, group, "quant_gemv");
  TORCH_CHECK(!mins.has_value() || c == QuantCode::kInt4,
              "core_C.quant_gemv: mins are taken with int4 codes only (code " + std::to_string(code) +
                  "); dequantize with quant_dequant and use a dense GEMM for this weight");
  if (zeros.has_value()) {  // the mins restated as integer zero points (quant_gemm.h)
    TORCH_CHECK(mins.has_value() && zeros->scalar_type() == at::kByte && zeros->is_contiguous() &&
                    zeros->sizes() == scales.sizes() && zeros->device() == codes.device(),
                "core_C.quant_gemv: zeros " + shape(*zeros) + " must come with mins and be contiguous uint8 "
                    "like scales " + shape(scales));
  }
  const int64_t per = c == QuantCode::kInt4 ? 32 : 16;  // inputs per 16-byte code vector
  TORCH_CHECK(group == k || (k / per) * (group / per) < (int64_t(1) << 32),
              "core_C.quant_gemv: k = " + std::to_string(k) + " with groups of " + std::to_string(group) +
                  ": (k / " + std::to_string(per) + ") * (group / " + std::to_string(per) +
                  ") must stay below 2^32 (the kernel's group lookup); dequantize this weight instead");
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(1) == k && x.stride(1) == 1 &&
                  x.device() == codes.device() && (x.stride(0) * x.element_size()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "core_C.quant_gemv: x " + shape(x) + " must be [m, " + std::to_string(k) +
                  "] on the weight's device with contiguous, 16-byte aligned rows");
  TORCH_CHECK(x.size(0) <= core_kernels::kQuantGemvMaxRows,
              "core_C.quant_gemv: " + std::to_string(x.size(0)) + " rows; at most " +
                  std::to_string(core_kernels::kQuantGemvMaxRows) + " (use quant_dequant + a GEMM)");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == out_cols,
              "core_C.quant_gemv: out " + shape(out) + " must be contiguous [" + std::to_string(x.size(0)) +
                  ", " + std::to_string(out_cols) + "] in x's dtype");
  core_kernels::QuantGemvArgs a{};
  a.out = out.data_ptr();
  a.x = x.data_ptr();
  a.codes = static_cast<const uint8_t*>(codes.data_ptr());
  a.scales = scales.data_ptr<float>();
  a.mins = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  a.zeros = zeros.has_value() ? static_cast<const uint8_t*>(zeros->data_ptr()) : nullptr;
  a.x_stride = x.stride(0);
  a.m = static_cast<int>(x.size(0));
  a.n = static_cast<int>(codes.size(0));
  a.k = static_cast<int>(k);
  a.group = static_cast<int>(group);
  a.code = c;
  a.dtype = dtype_of(x, "quant_gemv");
  a.tensor_cores = tensor_cores;
  return a;
}

// Whether quant_gemv takes a tensor-core kernel for x and this weight (no epilogue).
bool quant_gemv_tensor_cores(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& mins, int64_t code, int64_t group,
                             const c10::optional<at::Tensor>& zeros) {
  at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options());
  const core_kernels::QuantGemvArgs a =
      quant_gemv_args(out, x, codes, scales, mins, code, group, true, zeros, codes.size(0));
  const c10::cuda::CUDAGuard guard(x.device());
  return core_kernels::quant_gemv_tensor_cores(a);
}

// The weight's epilogues (one activation row of fp16/bf16, quant_gemm.h): the refusal names
// the op and what to call instead.
void check_epilogue_rows(const at::Tensor& x, const at::Tensor& codes, const char* op, const char* instead) {
  TORCH_CHECK(x.size(0) == 1 && (x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16) &&
                  codes.size(0) % 2 == 0,
              std::string("core_C.") + op + ": x " + shape(x) + " of " + c10::toString(x.scalar_type()) +
                  " and a weight of " + std::to_string(codes.size(0)) + " rows; the epilogue takes one float16 or "
                  "bfloat16 row and an even row count (use " + instead + ")");
}

void launch_quant_gemv(const core_kernels::QuantGemvArgs& a, const at::Tensor& x, const char* op) {
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(core_kernels::quant_gemv(a, c10::cuda::getCurrentCUDAStream()), op);
}

// out = x @ W^T; with silu_and_mul, W is [gate | up] and out [m, n / 2] = silu(gate) * up.
void quant_gemv(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                const c10::optional<at::Tensor>& mins, int64_t code, int64_t group, bool tensor_cores,
                const c10::optional<at::Tensor>& zeros, bool silu_and_mul) {
  if (silu_and_mul) check_epilogue_rows(x, codes, "quant_gemv", "quant_gemv, then silu_and_mul");
  core_kernels::QuantGemvArgs a = quant_gemv_args(out, x, codes, scales, mins, code, group, tensor_cores, zeros,
                                                  silu_and_mul ? codes.size(0) / 2 : codes.size(0));
  a.silu_and_mul = silu_and_mul;
  launch_quant_gemv(a, x, "quant_gemv");
}

// out = x @ W^T with the first rope_heads heads of head_size features of a fused QKV weight
// rotated by cos_sin[positions] (rotary_dim features a head), as rotary_embedding rotates them.
void quant_gemv_rope(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& mins, int64_t code, int64_t group,
                     const c10::optional<at::Tensor>& zeros, const at::Tensor& positions, const at::Tensor& cos_sin,
                     int64_t rope_heads, int64_t head_size, int64_t rotary_dim) {
  check_epilogue_rows(x, codes, "quant_gemv_rope", "quant_gemv, then rotary_embedding");
  core_kernels::QuantGemvArgs a = quant_gemv_args(out, x, codes, scales, mins, code, group, false, zeros,
                                                  codes.size(0));
  a.rope = core_kernels::checked_rope("core_C.quant_gemv_rope", x, codes.size(0), positions, cos_sin, rope_heads,
                                      head_size, rotary_dim);
  launch_quant_gemv(a, x, "quant_gemv_rope");
}

void quant_dequant(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                   const c10::optional<at::Tensor>& mins, int64_t code, int64_t group) {
  const QuantCode c = code_of(code, "quant_dequant");
  const int64_t k = check_weight(codes, scales, mins, c, group, "quant_dequant");
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == codes.size(0) && out.size(1) == k &&
                  out.device() == codes.device(),
              "core_C.quant_dequant: out " + shape(out) + " must be contiguous [" +
                  std::to_string(codes.size(0)) + ", " + std::to_string(k) + "] on the weight's device");
  const c10::cuda::CUDAGuard guard(codes.device());
  core_kernels::QuantDequantArgs a{};
  a.out = out.data_ptr();
  a.codes = static_cast<const uint8_t*>(codes.data_ptr());
  a.scales = scales.data_ptr<float>();
  a.mins = mins.has_value() ? mins->data_ptr<float>() : nullptr;
  a.n = static_cast<int>(codes.size(0));
  a.k = static_cast<int>(k);
  a.group = static_cast<int>(group);
  a.code = c;
  a.dtype = dtype_of(out, "quant_dequant");
  check_launch(core_kernels::quant_dequant(a, c10::cuda::getCurrentCUDAStream()), "quant_dequant");
}

void quant_fp8_activations(at::Tensor& codes, at::Tensor& scales, const at::Tensor& x, int64_t group) {
  const char* op = "quant_fp8_activations";
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.stride(1) == 1 && (x.stride(0) * x.element_size()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "core_C.quant_fp8_activations: x " + shape(x) +
                  " must be a 2-D CUDA tensor with contiguous, 16-byte aligned rows");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 8 == 0 && (group == k || (group == 128 && k % 128 == 0)),
              "core_C.quant_fp8_activations: group " + std::to_string(group) + " must be k (" +
                  std::to_string(k) + ", a multiple of 8) or 128 (k a multiple of 128)");
  TORCH_CHECK(codes.device() == x.device() && codes.is_contiguous() && codes.element_size() == 1 &&
                  codes.dim() == 2 && codes.size(0) >= m && codes.size(1) == k,
              "core_C.quant_fp8_activations: codes " + shape(codes) + " must be contiguous bytes [>= " +
                  std::to_string(m) + ", " + std::to_string(k) + "] on x's device");
  const int64_t m_total = codes.size(0);
  TORCH_CHECK(scales.device() == x.device() && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == m_total * (k / group),
              "core_C.quant_fp8_activations: scales " + shape(scales) + " must be contiguous float32 of " +
                  std::to_string(m_total * (k / group)) + " elements ([k / group, rows of codes])");
  const c10::cuda::CUDAGuard guard(x.device());
  core_kernels::Fp8ActivationArgs a{};
  a.codes = static_cast<uint8_t*>(codes.data_ptr());
  a.scales = scales.data_ptr<float>();
  a.x = x.data_ptr();
  a.x_stride = x.stride(0);
  a.m = static_cast<int>(m);
  a.m_total = static_cast<int>(m_total);
  a.k = static_cast<int>(k);
  a.group = static_cast<int>(group);
  a.dtype = dtype_of(x, op);
  check_launch(core_kernels::quant_fp8_activations(a, c10::cuda::getCurrentCUDAStream()), op);
}

// ---- Meta: ranks only (sizes may be symbolic under torch.compile) ----------------------------
void quant_gemv_meta(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>&, int64_t, int64_t, bool, const c10::optional<at::Tensor>&, bool) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2,
              "quant_gemv: expected 2-d out, x, codes and scales");
}

void quant_gemv_rope_meta(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const c10::optional<at::Tensor>&, int64_t, int64_t, const c10::optional<at::Tensor>&,
                          const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t) {
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && codes.dim() == 2 && scales.dim() == 2,
              "quant_gemv_rope: expected 2-d out, x, codes and scales");
}

void quant_dequant_meta(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>&, int64_t, int64_t) {
  TORCH_CHECK(out.dim() == 2 && codes.dim() == 2 && scales.dim() == 2,
              "quant_dequant: expected 2-d out, codes and scales");
}

}  // namespace

void quant_fp8_activations_meta(at::Tensor& codes, at::Tensor&, const at::Tensor& x, int64_t) {
  TORCH_CHECK(codes.dim() == 2 && x.dim() == 2, "quant_fp8_activations: expected 2-d codes and x");
}

TORCH_LIBRARY_FRAGMENT(core_C, m) {
  m.def("quant_fp8_activations(Tensor(a!) codes, Tensor(b!) scales, Tensor x, int group) -> ()");
  m.def(
      "quant_gemv(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor? mins, int code, "
      "int group, bool tensor_cores=True, Tensor? zeros=None, bool silu_and_mul=False) -> ()");
  m.def(
      "quant_gemv_tensor_cores(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int code, int group, "
      "Tensor? zeros=None) -> bool");
  m.def(
      "quant_gemv_rope(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor? mins, int code, "
      "int group, Tensor? zeros, Tensor positions, Tensor cos_sin, int rope_heads, int head_size, "
      "int rotary_dim) -> ()");
  m.def(
      "quant_dequant(Tensor(a!) out, Tensor codes, Tensor scales, Tensor? mins, int code, "
      "int group) -> ()");
}

TORCH_LIBRARY_IMPL(core_C, CUDA, m) {
  m.impl("quant_gemv", &quant_gemv);
  m.impl("quant_gemv_rope", &quant_gemv_rope);
  m.impl("quant_gemv_tensor_cores", &quant_gemv_tensor_cores);
  m.impl("quant_dequant", &quant_dequant);
  m.impl("quant_fp8_activations", &quant_fp8_activations);
}

TORCH_LIBRARY_IMPL(core_C, Meta, m) {
  m.impl("quant_gemv", &quant_gemv_meta);
  m.impl("quant_gemv_rope", &quant_gemv_rope_meta);
  m.impl("quant_dequant", &quant_dequant_meta);
  m.impl("quant_fp8_activations", &quant_fp8_activations_meta);
}
