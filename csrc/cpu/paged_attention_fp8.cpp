// FP8 (e4m3) KV cache ops of the CPU attention backend: write_kv and paged_decode of
// paged_attention.cpp over a float8_e4m3fn cache (same layout, same table_rows convention for
// prompt rows). Only the quantizing store and the scale checks live here; the decode is the
// kernel of paged_attention.cpp instantiated for fp8 codes (its to_f32 / load8 for fp8_t).
//
// Format (core/quantization/kv_cache.py): the cache holds fp8(clamp(x * inv_scale, +-448)),
// rounded to nearest even, with inv_scale = float32(1 / scale) and one scale per layer for keys
// and one for values; attention reads code * scale.
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

#include "paged_attention.h"

namespace core_cpu {
namespace {

constexpr float kFp8Max = 448.f;

void check_fp8_cache(const at::Tensor& kv_cache, const char* op) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat8_e4m3fn, op, ": kv_cache must be float8_e4m3fn, got ",
              kv_cache.scalar_type(), " (write_kv / paged_decode take caches of the model's dtype)");
}

void check_scale(double s, const char* op, const char* what) {
  TORCH_CHECK(s > 0.0 && std::isfinite(s), op, ": ", what, " ", s, " must be a positive finite number");
}

template <typename F>
void dispatch_compute_types(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

template <typename T>
void quantize_row(uint8_t* dst, const T* src, int64_t n, float inv) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::clamp(static_cast<float>(src[i]) * inv, -kFp8Max, kFp8Max);  // NaN stays NaN
    dst[i] = c10::Float8_e4m3fn(y).x;  // round to nearest even, as torch's .to()
  }
}

}  // namespace

// Quantizes key/value rows into their slots; negative slots are padding and skipped.
void write_kv_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slots,
                  double k_scale, double v_scale) {
  check_fp8_cache(kv_cache, "write_kv_fp8");
  check_scale(k_scale, "write_kv_fp8", "k_scale");
  check_scale(v_scale, "write_kv_fp8", "v_scale");
  const KvWrite w = check_kv_write(key, value, kv_cache, slots, "write_kv_fp8");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv_fp8: key dtype ", key.scalar_type(),
              " and value dtype ", value.scalar_type(), " differ");
  const float k_inv = static_cast<float>(1.0 / k_scale), v_inv = static_cast<float>(1.0 / v_scale);
  uint8_t* kdst = reinterpret_cast<uint8_t*>(kv_cache.data_ptr());
  uint8_t* vdst = kdst + w.num_slots * w.row;
  dispatch_compute_types(key.scalar_type(), "write_kv_fp8", [&](auto tag) {
    using T = decltype(tag);
    const T* ks = reinterpret_cast<const T*>(key.data_ptr());
    const T* vs = reinterpret_cast<const T*>(value.data_ptr());
    for_each_written_slot(w, 16, [&](int64_t t, int64_t slot) {
      quantize_row(kdst + slot * w.row, ks + t * key.stride(0), w.row, k_inv);
      quantize_row(vdst + slot * w.row, vs + t * value.stride(0), w.row, v_inv);
    });
  });
}

// out[b] = softmax(scale * q[b] K^T) V over an fp8 cache (K, V read as code * k_scale,
// code * v_scale); otherwise the contract of paged_decode (rows, table_rows, window, soft cap).
void paged_decode_fp8(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                      const std::optional<at::Tensor>& table_rows, double logits_soft_cap, double k_scale,
                      double v_scale) {
  check_fp8_cache(kv_cache, "paged_decode_fp8");
  check_scale(k_scale, "paged_decode_fp8", "k_scale");
  check_scale(v_scale, "paged_decode_fp8", "v_scale");
  paged_decode_scaled(out, query, kv_cache, block_tables, seq_lens, scale, window, table_rows, logits_soft_cap,
                      k_scale, v_scale, "paged_decode_fp8");
}

}  // namespace core_cpu
