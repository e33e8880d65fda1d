// torch op over quant_gemm.cpp: out [M, N] fp32 = x [M, K] fp32 @ W^T for int4 / int8 weights
// in groups of 32 (platforms/cpu/linear.py packs them), on the ISA path in force (isa.h).
//
// Work is split into blocks of activation rows x weight rows: up to 64 rows (decode) blocks
// of 16 weight rows, so both threads stream weights and the few blocks of a small layer (576
// outputs: 36) split evenly; with more rows (prompts) 64 x 64 blocks, whose weight rows
// (<= 48 KiB) and int8 activation rows (<= 96 KiB) stay in L2 while every pair of them is
// multiplied.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "isa.h"
#include "quant_gemm.h"

namespace core_cpu {

namespace {

QuantWeights check_weights(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                           int64_t bits, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(k % kQuantGroup == 0, "quant_linear: in_features ", k, " is not a multiple of the group size ",
              kQuantGroup);
  const int64_t n = codes.size(0), per_row = bits == 4 ? k / 2 : k;
  TORCH_CHECK(codes.dim() == 2 && codes.size(1) == per_row && codes.is_contiguous()
              && codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar),
              "quant_linear: int", bits, " codes must be contiguous ", bits == 4 ? "uint8" : "int8", " [out, ",
              per_row, "], got ", codes.scalar_type(), " ", codes.sizes());
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / kQuantGroup
              && scales.is_contiguous() && (half || scales.scalar_type() == at::kFloat),
              "quant_linear: scales must be contiguous float32 or float16 [", n, ", ", k / kQuantGroup, "], got ",
              scales.scalar_type(), " ", scales.sizes());
  const void* mp = nullptr;
  if (bits == 4) {
    TORCH_CHECK(mins.has_value() && mins->sizes() == scales.sizes() && mins->is_contiguous()
                && mins->scalar_type() == scales.scalar_type(),
                "quant_linear: int4 needs mins shaped like scales, of their dtype (", scales.scalar_type(), ")");
    mp = mins->data_ptr();
  }
  return {static_cast<int>(bits), reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr(), mp, n, k,
          half};
}

}  // namespace

// act_mode 0: fp32 activations (weights dequantized in registers); 1: int8 activations.
void quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                  const std::optional<at::Tensor>& mins, int64_t bits, int64_t act_mode) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "quant_linear: x must be float32 [rows, in_features] with contiguous rows, got ", x.scalar_type(), " ",
              x.sizes());
  const int64_t m = x.size(0), k = x.size(1);
  const QuantWeights w = check_weights(codes, scales, mins, bits, k);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == w.n && out.stride(1) == 1
              && out.scalar_type() == at::kFloat, "quant_linear: out must be float32 [", m, ", ", w.n, "]");
  TORCH_CHECK(act_mode == 0 || act_mode == 1, "quant_linear: act_mode must be 0 (fp32) or 1 (int8), got ", act_mode);
  if (m == 0 || w.n == 0) return;
  const Isa isa = active_isa();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), ldo = out.stride(0), groups = k / kQuantGroup;
  const int64_t mb = m == 1 ? 1 : 64, nb = m <= 64 ? 16 : 64;
  const int64_t row_blocks = (m + mb - 1) / mb, col_blocks = (w.n + nb - 1) / nb;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  if (act_mode == 1) {
    q.resize(static_cast<size_t>(m * k));
    d.resize(static_cast<size_t>(m * groups));
    s.resize(static_cast<size_t>(m * groups));
    at::parallel_for(0, m, std::max<int64_t>(1, 16384 / k), [&](int64_t b, int64_t e) {
      quantize_rows(isa, xp, ldx, k, b, e, q.data(), d.data(), s.data());
    });
  }
  const QuantActs acts{q.data(), d.data(), s.data()};
  // Column blocks vary fastest: neighbouring tasks share their activation rows.
  at::parallel_for(0, row_blocks * col_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t m0 = (t / col_blocks) * mb, n0 = (t % col_blocks) * nb;
      const int64_t m1 = std::min(m, m0 + mb), n1 = std::min(w.n, n0 + nb);
      if (act_mode == 1) quant_gemm_int8(isa, op, ldo, acts, m0, m1, w, n0, n1);
      else quant_gemm_f32(isa, op, ldo, xp, ldx, m0, m1, w, n0, n1);
    }
  });
}

// out [N, K] fp32 = the weight the codes stand for (w = code * scale + min, or code * scale), in
// the same fp32 arithmetic as GroupedQuant.dequantize: prompts multiply by it through the dense
// GEMM when the layer keeps no dense copy (platforms/cpu/linear.py), so it must be the dense
// weight bit for bit: no fused multiply-add (torch rounds the product, then the sum). Plain
// loops over one group at a time, which the compiler vectorises; rows split across threads.
#if defined(__GNUC__) && !defined(__clang__)
#define CORE_NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define CORE_NO_FP_CONTRACT
#endif

namespace {

CORE_NO_FP_CONTRACT void dequantize_rows(const QuantWeights& w, float* out, int64_t r0, int64_t r1) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
  const int64_t groups = w.k / kQuantGroup, per_row = w.bits == 4 ? w.k / 2 : w.k;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* c = w.codes + r * per_row;
    float* o = out + r * w.k;
    for (int64_t g = 0; g < groups; ++g, o += kQuantGroup) {
      const float d = scale_of(w, r * groups + g);
      if (w.bits == 8) {
        const int8_t* q = reinterpret_cast<const int8_t*>(c) + g * kQuantGroup;
        for (int j = 0; j < kQuantGroup; ++j) o[j] = static_cast<float>(q[j]) * d;
      } else {
        const uint8_t* q = c + g * (kQuantGroup / 2);
        const float mn = min_of(w, r * groups + g);
        for (int j = 0; j < kQuantGroup / 2; ++j) {
          o[j] = static_cast<float>(q[j] & 15) * d + mn;
          o[j + kQuantGroup / 2] = static_cast<float>(q[j] >> 4) * d + mn;
        }
      }
    }
  }
}

}  // namespace

void quant_dequantize(at::Tensor& out, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t bits) {
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat,
              "quant_dequantize: out must be contiguous float32 [out, in], got ", out.scalar_type(), " ", out.sizes());
  const QuantWeights w = check_weights(codes, scales, mins, bits, out.size(1));
  TORCH_CHECK(out.size(0) == w.n, "quant_dequantize: out has ", out.size(0), " rows, the codes ", w.n);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, w.n, std::max<int64_t>(1, 65536 / w.k),
                   [&](int64_t b, int64_t e) { dequantize_rows(w, op, b, e); });
}

std::string cpu_isa() { return isa_name(active_isa()); }

std::string set_cpu_isa(const std::string& name) {
  try {
    return isa_name(set_isa(name));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
  return {};
}

std::vector<std::string> cpu_isas() {
  std::vector<std::string> names;
  for (Isa isa : runnable_isas()) names.emplace_back(isa_name(isa));
  return names;
}

}  // namespace core_cpu
