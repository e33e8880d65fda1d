// Registers the CPU kernels as torch ops in the ``core_cpu`` namespace (torch.ops.core_cpu.*),
// loaded by platforms/cpu/kernels.py. Every op writes into outputs its caller allocated.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "ops.h"

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
