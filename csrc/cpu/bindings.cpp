// Registers the CPU kernels as torch ops in the ``core_cpu`` namespace (torch.ops.core_cpu.*),
// loaded by platforms/cpu/kernels.py. Every op writes into outputs its caller allocated.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace core_cpu {
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& out, at::Tensor& new_residual, const at::Tensor& x,
                        const at::Tensor& residual, const at::Tensor& weight, double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);
void rotary_embedding(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& positions,
                      const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos_sin_cache,
                      int64_t rotary_dim);
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slots);
void paged_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  const std::optional<at::Tensor>& table_rows, double logits_soft_cap);
void write_kv_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slots,
                  double k_scale, double v_scale);
void paged_decode_fp8(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                      const std::optional<at::Tensor>& table_rows, double logits_soft_cap, double k_scale,
                      double v_scale);
void linear_f32out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight);
void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, int64_t bits, int64_t act_mode);
void quant_dequantize(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t bits);
std::string cpu_isa();
std::string set_cpu_isa(const std::string& name);
std::vector<std::string> cpu_isas();
}  // namespace core_cpu

TORCH_LIBRARY(core_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor(b!) new_residual, Tensor x, Tensor residual, "
        "Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_embedding(Tensor(a!) q_out, Tensor(b!) k_out, Tensor positions, Tensor query, Tensor key, "
        "Tensor cos_sin_cache, int rotary_dim) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots) -> ()");
  m.def("paged_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "float scale, int window, Tensor? table_rows=None, float logits_soft_cap=0.0) -> ()");
  m.def("write_kv_fp8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots, float k_scale=1.0, "
        "float v_scale=1.0) -> ()");
  m.def("paged_decode_fp8(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, Tensor? table_rows=None, float logits_soft_cap=0.0, "
        "float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def("linear_f32out(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.def("quant_linear(Tensor(a!) out, Tensor x, Tensor codes, Tensor scales, Tensor? mins, int bits, "
        "int act_mode) -> ()");
  m.def("quant_dequantize(Tensor(a!) out, Tensor codes, Tensor scales, Tensor? mins, int bits) -> ()");
  // The ISA path in force (isa.h): no tensors, so registered with their one implementation.
  m.def("cpu_isa() -> str", &core_cpu::cpu_isa);
  m.def("set_cpu_isa(str name) -> str", &core_cpu::set_cpu_isa);
  m.def("cpu_isas() -> str[]", &core_cpu::cpu_isas);
}

TORCH_LIBRARY_IMPL(core_cpu, CPU, m) {
  m.impl("rms_norm", &core_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &core_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &core_cpu::silu_and_mul);
  m.impl("rotary_embedding", &core_cpu::rotary_embedding);
  m.impl("write_kv", &core_cpu::write_kv);
  m.impl("paged_decode", &core_cpu::paged_decode);
  m.impl("write_kv_fp8", &core_cpu::write_kv_fp8);
  m.impl("paged_decode_fp8", &core_cpu::paged_decode_fp8);
  m.impl("linear_f32out", &core_cpu::linear_f32out);
  m.impl("quant_linear", &core_cpu::quant_linear);
  m.impl("quant_dequantize", &core_cpu::quant_dequantize);
}
