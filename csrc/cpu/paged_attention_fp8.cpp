// FP8 (e4m3) KV cache ops of the CPU attention backend: the float8_e4m3fn-cache twins of
// write_kv and paged_decode in paged_attention.cpp (same cache layout, same table_rows
// convention for prompt rows, same block-cyclic task split).
//
// Format (core/quantization/kv_cache.py): the cache holds fp8(clamp(x * inv_scale, +-448)),
// rounded to nearest even, with inv_scale = float32(1 / scale) and one scale per layer for keys
// and one for values; attention reads code * scale. The key scale is folded into the
// pre-scaled query and the value scale into the output, so the inner loops only widen codes.
//
// The decode loops are plain C++ written for the vectoriser (-O3 -march=native): each cached
// row is widened to fp32 once and used by every query head of its kv head's group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_math.h"

namespace core_cpu {
namespace {

constexpr float kFp8Max = 448.f;

// e4m3fn code -> float, exact for every finite code. Built from normal floats only (the
// mantissa as a small integer times a power of two), so a process that flushes denormals
// (DAZ/FTZ) still reads subnormal codes right; branch-free, so row loops vectorise. The NaN
// codes (0x7f, 0xff) never occur in a cache the write op filled from finite values.
inline float fp8_to_f32(uint8_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const uint32_t mant = e ? (m | 8u) : m;        // 1.mmm as an integer, or 0.mmm
  const uint32_t pow2 = ((e ? e : 1u) + 117u) << 23;  // 2^(max(e, 1) - 10)
  const float v = static_cast<float>(mant) * bits_to_float(pow2);
  return (b & 0x80u) ? -v : v;
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }
inline float widen(c10::Half v) { return static_cast<float>(v); }

template <typename F>
void dispatch_compute_types(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

void check_fp8_cache(const at::Tensor& kv_cache, const char* op) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kFloat8_e4m3fn,
              op, ": kv_cache must be a contiguous float8_e4m3fn [2, blocks, block_size, kv_heads, "
              "head_size] tensor, got ", kv_cache.scalar_type(), " ", kv_cache.sizes());
}

void check_rows(const at::Tensor& t, int64_t heads, int64_t d, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == d && t.stride(2) == 1 && t.stride(1) == d,
              what, " must be [tokens, ", heads, ", ", d, "] with contiguous heads, got sizes ", t.sizes(),
              " strides ", t.strides());
}

void check_scale(double s, const char* what) {
  TORCH_CHECK(s > 0.0 && std::isfinite(s), what, " ", s, " must be a positive finite number");
}

template <typename T>
void quantize_row(uint8_t* dst, const T* src, int64_t n, float inv) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::clamp(widen(src[i]) * inv, -kFp8Max, kFp8Max);  // NaN stays NaN
    dst[i] = c10::Float8_e4m3fn(y).x;  // round to nearest even, as torch's .to()
  }
}

}  // namespace

// Quantizes key/value rows into their slots; negative slots are padding and skipped.
void write_kv_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slots,
                  double k_scale, double v_scale) {
  check_fp8_cache(kv_cache, "write_kv_fp8");
  check_scale(k_scale, "write_kv_fp8: k_scale");
  check_scale(v_scale, "write_kv_fp8: v_scale");
  const int64_t kvh = kv_cache.size(3), d = kv_cache.size(4), row = kvh * d;
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), tokens = key.size(0);
  check_rows(key, kvh, d, "write_kv_fp8 key");
  check_rows(value, kvh, d, "write_kv_fp8 value");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "write_kv_fp8: key and value dtypes differ");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == tokens &&
                  value.size(0) == tokens, "write_kv_fp8: slot_mapping must be contiguous int64 [tokens]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(sp[t] < num_slots, "write_kv_fp8: slot ", sp[t], " is outside the cache's ", num_slots, " slots");
  }
  const float k_inv = static_cast<float>(1.0 / k_scale), v_inv = static_cast<float>(1.0 / v_scale);
  uint8_t* kdst = reinterpret_cast<uint8_t*>(kv_cache.data_ptr());
  uint8_t* vdst = kdst + num_slots * row;
  dispatch_compute_types(key.scalar_type(), "write_kv_fp8", [&](auto tag) {
    using T = decltype(tag);
    const T* ks = reinterpret_cast<const T*>(key.data_ptr());
    const T* vs = reinterpret_cast<const T*>(value.data_ptr());
    at::parallel_for(0, tokens, 16, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        if (sp[t] < 0) continue;
        quantize_row(kdst + sp[t] * row, ks + t * key.stride(0), row, k_inv);
        quantize_row(vdst + sp[t] * row, vs + t * value.stride(0), row, v_inv);
      }
    });
  });
}

namespace {

template <typename T>
struct Fp8DecodeArgs {
  T* out;
  const T* query;
  int64_t out_stride, q_stride;
  const uint8_t* keys;    // cache[0]
  const uint8_t* values;  // cache[1]
  int64_t block_size, kv_heads, head_size, group;
  const int32_t* tables;
  const int32_t* table_rows;  // query row -> block-table row; null: row b uses table row b
  int64_t table_stride;
  const int32_t* seq_lens;
  float q_scale;   // softmax scale * k_scale
  float v_scale;
  int64_t window;  // <= 0: whole context
  float soft_cap;  // <= 0: none
};

// Cached row of kv head h at position p of query row b's sequence.
template <typename T>
inline const uint8_t* cached_row(const Fp8DecodeArgs<T>& a, const uint8_t* base, const int32_t* table, int64_t p,
                                 int64_t h) {
  const int64_t bs = a.block_size;
  return base + ((static_cast<int64_t>(table[p / bs]) * bs + p % bs) * a.kv_heads + h) * a.head_size;
}

// One (query row, kv head): the `group` query heads that share it.
template <typename T>
void decode_fp8_one(const Fp8DecodeArgs<T>& a, int64_t b, int64_t h, std::vector<float>& buf) {
  const int64_t d = a.head_size, g_n = a.group;
  const int64_t len = a.seq_lens[b], start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - start;
  const int32_t* table = a.tables + (a.table_rows ? a.table_rows[b] : b) * a.table_stride;
  buf.resize(static_cast<size_t>(g_n * (2 * d + n) + d));
  float* q = buf.data();       // [group, d], pre-scaled by scale * k_scale
  float* acc = q + g_n * d;    // [group, d]
  float* row = acc + g_n * d;  // [d] one cached row in fp32
  float* scores = row + d;     // [group, n]
  for (int64_t g = 0; g < g_n; ++g) {
    const T* src = a.query + b * a.q_stride + (h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) q[g * d + i] = widen(src[i]) * a.q_scale;
  }
  for (int64_t p = start; p < len; ++p) {
    const uint8_t* k = cached_row(a, a.keys, table, p, h);
    for (int64_t i = 0; i < d; ++i) row[i] = fp8_to_f32(k[i]);
    for (int64_t g = 0; g < g_n; ++g) scores[g * n + p - start] = dot(q + g * d, row, d);
  }
  for (int64_t g = 0; g < g_n; ++g) {
    float* s = scores + g * n;
    if (a.soft_cap > 0.f) {
      const float inv = 1.f / a.soft_cap;
      for (int64_t j = 0; j < n; ++j) s[j] = a.soft_cap * std::tanh(s[j] * inv);
    }
    softmax_inplace(s, n);
  }
  std::fill(acc, acc + g_n * d, 0.f);
  for (int64_t p = start; p < len; ++p) {
    const uint8_t* v = cached_row(a, a.values, table, p, h);
    for (int64_t i = 0; i < d; ++i) row[i] = fp8_to_f32(v[i]);
    for (int64_t g = 0; g < g_n; ++g) {
      const float w = scores[g * n + p - start];
      float* ag = acc + g * d;
      for (int64_t i = 0; i < d; ++i) ag[i] += w * row[i];
    }
  }
  for (int64_t g = 0; g < g_n; ++g) {
    T* dst = a.out + b * a.out_stride + (h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[g * d + i] * a.v_scale);
  }
}

// Checks every index the kernel will follow, once, so the loops can index freely.
void check_tables(const at::Tensor& block_tables, const int32_t* rows, const int32_t* lens, int64_t seqs,
                  int64_t nb, int64_t bs) {
  const int64_t table_count = block_tables.size(0), width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<int64_t> used(static_cast<size_t>(table_count), 0);
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t r = rows ? rows[b] : b;
    TORCH_CHECK(r >= 0 && r < table_count, "paged_decode_fp8: table row ", r, " of query row ", b,
                " is outside [0, ", table_count, ")");
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + bs - 1) / bs <= width, "paged_decode_fp8: query row ", b,
                " has length ", lens[b], " but its block table holds ", width, " blocks of ", bs);
    used[r] = std::max<int64_t>(used[r], (lens[b] + bs - 1) / bs);
  }
  for (int64_t r = 0; r < table_count; ++r) {
    for (int64_t i = 0; i < used[r]; ++i) {
      const int32_t blk = tables[r * block_tables.stride(0) + i];
      TORCH_CHECK(blk >= 0 && blk < nb, "paged_decode_fp8: block ", blk, " of table row ", r,
                  " is outside [0, ", nb, ")");
    }
  }
}

}  // namespace

// out[b] = softmax(scale * q[b] K^T) V over an fp8 cache (K, V read as code * k_scale,
// code * v_scale); otherwise the contract of paged_decode (rows, table_rows, window, soft cap).
void paged_decode_fp8(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                      const std::optional<at::Tensor>& table_rows, double logits_soft_cap, double k_scale,
                      double v_scale) {
  check_fp8_cache(kv_cache, "paged_decode_fp8");
  check_scale(k_scale, "paged_decode_fp8: k_scale");
  check_scale(v_scale, "paged_decode_fp8: v_scale");
  TORCH_CHECK(logits_soft_cap >= 0.0, "paged_decode_fp8: logits_soft_cap ", logits_soft_cap,
              " must be 0 (no capping) or positive");
  const int64_t seqs = query.size(0), heads = query.size(1);
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3), d = kv_cache.size(4);
  check_rows(query, heads, d, "paged_decode_fp8 query");
  check_rows(out, heads, d, "paged_decode_fp8 out");
  TORCH_CHECK(heads % kvh == 0, "paged_decode_fp8: ", heads, " query heads are not a multiple of ", kvh,
              " kv heads");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "paged_decode_fp8: out dtype must be query's");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kInt &&
                  (table_rows.has_value() || block_tables.size(0) == seqs),
              "paged_decode_fp8: block_tables must be int32 [seqs, blocks] (or any rows with table_rows)");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.numel() == seqs && seq_lens.scalar_type() == at::kInt,
              "paged_decode_fp8: seq_lens must be contiguous int32 [rows]");
  const int32_t* rows = nullptr;
  if (table_rows.has_value()) {
    TORCH_CHECK(table_rows->is_contiguous() && table_rows->numel() == seqs && table_rows->scalar_type() == at::kInt,
                "paged_decode_fp8: table_rows must be contiguous int32 [rows]");
    rows = table_rows->data_ptr<int32_t>();
  }
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  check_tables(block_tables, rows, lens, seqs, nb, bs);
  const uint8_t* keys = reinterpret_cast<const uint8_t*>(kv_cache.data_ptr());
  dispatch_compute_types(query.scalar_type(), "paged_decode_fp8", [&](auto tag) {
    using T = decltype(tag);
    const Fp8DecodeArgs<T> a{reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const T*>(query.data_ptr()),
                             out.stride(0), query.stride(0), keys, keys + nb * bs * kvh * d, bs, kvh, d, heads / kvh,
                             block_tables.data_ptr<int32_t>(), rows, block_tables.stride(0), lens,
                             static_cast<float>(scale * k_scale), static_cast<float>(v_scale), window,
                             static_cast<float>(logits_soft_cap)};
    // One task per (row, kv head), dealt block-cyclically as in paged_decode: prompt rows grow
    // longer down the batch, and neighbouring rows read the same blocks.
    const int64_t tasks = seqs * kvh;
    constexpr int64_t kSpread = 8;
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
    const int64_t block = std::max<int64_t>(1, tasks / (threads * kSpread));
    const int64_t blocks = (tasks + block - 1) / block;
    const int64_t per_thread = (blocks + threads - 1) / threads;
    at::parallel_for(0, per_thread * threads * block, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;
      for (int64_t i = begin; i < end; ++i) {
        const int64_t bi = i / block;
        const int64_t task = ((bi % per_thread) * threads + bi / per_thread) * block + i % block;
        if (task < tasks) decode_fp8_one(a, task / kvh, task % kvh, buf);
      }
    });
  });
}

}  // namespace core_cpu
