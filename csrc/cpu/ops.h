// Every op of the CPU kernels (the torch.ops.core_cpu library), declared once: bindings.cpp
// registers them and decode_stack.cpp calls them. No torch headers (as every header of csrc/:
// tests/compile/test_csrc_compiles.py), so at::Tensor is only declared.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace at {
class Tensor;
}  // namespace at

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
