// FP8 (e4m3) KV cache ops of the CPU attention backend: the float8_e4m3fn-cache twins of
// write_kv and paged_decode in paged_attention.cpp (same cache layout, same table_rows
// convention for prompt rows, same block-cyclic task split).
//
// Format (core/quantization/kv_cache.py): the cache holds fp8(clamp(x * inv_scale, +-448)),
// rounded to nearest even, with inv_scale = float32(1 / scale) and one scale per layer for keys
// and one for values; attention reads code * scale. The key scale is folded into the
// pre-scaled query and the value scale into the output, so the inner loops only widen codes.
//
// Decode: on x86 with AVX2 + FMA + F16C (head sizes 32-128), a register-blocked kernel that
// widens 8 codes at a time through F16C; elsewhere portable C++ written for the vectoriser.
// Either way each cached row is widened once and used by every query head of its group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CORE_FP8_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#include "cpu_math.h"
#include "isa.h"

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

// Scaled scores of one query head -> softmax weights (soft-capped first when cap > 0).
inline void soft_cap_and_softmax(float* s, int64_t n, float cap) {
  if (cap > 0.f) {
    const float inv = 1.f / cap;
    for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] * inv);
  }
  softmax_inplace(s, n);
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
  for (int64_t g = 0; g < g_n; ++g) soft_cap_and_softmax(scores + g * n, n, a.soft_cap);
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

template <typename T>
void decode_fp8_heads_generic(const Fp8DecodeArgs<T>& a, int64_t b, int64_t h0, int64_t h1,
                              std::vector<float>& buf) {
  for (int64_t h = h0; h < h1; ++h) decode_fp8_one(a, b, h, buf);
}

#if defined(CORE_FP8_AVX2)
constexpr int64_t kMaxQueries = 32;  // query heads per task (q and accumulators stay on stack)

// 8 e4m3 codes -> 8 floats equal to code / 256, exactly: a code's sign, 4 exponent and 3
// mantissa bits placed as an fp16's (bias 15 instead of 7, so 2^-8 times the value; fp8
// subnormals become fp16 subnormals, which F16C converts exactly). The 256 is folded into
// the query and output scales.
CORE_FP8_AVX2 inline __m256 load8_fp8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}
CORE_FP8_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
CORE_FP8_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
CORE_FP8_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
CORE_FP8_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scores of positions [start, len) of row b for query heads of kv heads [h0, h0 + heads).
template <typename T, int NV>
CORE_FP8_AVX2 void fp8_scores_avx2(const Fp8DecodeArgs<T>& a, int64_t b, int64_t h0, int64_t heads,
                                   int64_t start, int64_t len, float* scores) {
  constexpr int64_t D = NV * 8;
  const int64_t g_n = a.group, n = len - start, bs = a.block_size, row = a.kv_heads * D;
  const int32_t* table = a.tables + (a.table_rows ? a.table_rows[b] : b) * a.table_stride;
  __m256 q[kMaxQueries][NV];
  const __m256 scale = _mm256_set1_ps(a.q_scale * 256.f);
  const T* qsrc = a.query + b * a.q_stride + h0 * g_n * D;
  for (int64_t i = 0; i < heads * g_n; ++i)
    for (int v = 0; v < NV; ++v) q[i][v] = _mm256_mul_ps(load8(qsrc + i * D + 8 * v), scale);
  for (int64_t p = start; p < len; ++p) {
    const uint8_t* k = a.keys + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row + h0 * D;
    for (int64_t h = 0; h < heads; ++h) {
      __m256 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load8_fp8(k + h * D + 8 * v);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t i = h * g_n + g;
        __m256 acc = _mm256_mul_ps(q[i][0], kv[0]);
        for (int v = 1; v < NV; ++v) acc = _mm256_fmadd_ps(q[i][v], kv[v], acc);
        scores[i * n + p - start] = hsum8(acc);
      }
    }
  }
}

// Register-blocked decode of kv heads [h0, h1) of row b (AVX2 + FMA + F16C, head NV * 8).
template <typename T, int NV>
CORE_FP8_AVX2 void decode_fp8_avx2(const Fp8DecodeArgs<T>& a, int64_t b, int64_t h0, int64_t h1,
                                   std::vector<float>& buf) {
  constexpr int64_t D = NV * 8;
  const int64_t g_n = a.group, heads = h1 - h0, nq = heads * g_n, bs = a.block_size, row = a.kv_heads * D;
  const int64_t len = a.seq_lens[b], start = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t n = len - start;
  const int32_t* table = a.tables + (a.table_rows ? a.table_rows[b] : b) * a.table_stride;
  buf.resize(static_cast<size_t>(nq * n));
  float* scores = buf.data();  // [nq, n]
  fp8_scores_avx2<T, NV>(a, b, h0, heads, start, len, scores);
  for (int64_t i = 0; i < nq; ++i) soft_cap_and_softmax(scores + i * n, n, a.soft_cap);
  __m256 acc[kMaxQueries][NV];
  for (int64_t i = 0; i < nq; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t p = start; p < len; ++p) {
    const uint8_t* val = a.values + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row + h0 * D;
    for (int64_t h = 0; h < heads; ++h) {
      __m256 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load8_fp8(val + h * D + 8 * v);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t i = h * g_n + g;
        const __m256 w = _mm256_set1_ps(scores[i * n + p - start]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(w, vv[v], acc[i][v]);
      }
    }
  }
  alignas(32) float tmp[D];
  const __m256 out_scale = _mm256_set1_ps(a.v_scale * 256.f);
  T* dst = a.out + b * a.out_stride + h0 * g_n * D;
  for (int64_t i = 0; i < nq; ++i) {
    for (int v = 0; v < NV; ++v) _mm256_store_ps(tmp + 8 * v, _mm256_mul_ps(acc[i][v], out_scale));
    for (int64_t e = 0; e < D; ++e) dst[i * D + e] = static_cast<T>(tmp[e]);
  }
}
#endif

template <typename T>
using Fp8DecodeFn = void (*)(const Fp8DecodeArgs<T>&, int64_t, int64_t, int64_t, std::vector<float>&);

// The routine for this head size and group, and how many kv heads one task may take.
template <typename T>
std::pair<Fp8DecodeFn<T>, int64_t> pick_fp8_decode(int64_t head_size, int64_t group) {
#if defined(CORE_FP8_AVX2)
  const Isa isa = active_isa();
  if ((isa == Isa::kAvx2 || isa == Isa::kAvx512) && group <= kMaxQueries) {
    if (head_size == 128) return {&decode_fp8_avx2<T, 16>, kMaxQueries / group};
    if (head_size == 64) return {&decode_fp8_avx2<T, 8>, kMaxQueries / group};
    if (head_size == 96) return {&decode_fp8_avx2<T, 12>, kMaxQueries / group};
    if (head_size == 32) return {&decode_fp8_avx2<T, 4>, kMaxQueries / group};
  }
#endif
  (void)head_size;
  (void)group;
  return {&decode_fp8_heads_generic<T>, 1};
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
    // Whole rows per task when there are enough rows to keep every thread busy, else one kv
    // head per task; tasks dealt block-cyclically as in paged_decode (prompt rows grow longer
    // down the batch, and neighbouring rows read the same blocks).
    const auto [decode, max_heads] = pick_fp8_decode<T>(d, heads / kvh);
    const int64_t per_task = seqs >= at::get_num_threads() ? std::min(kvh, max_heads) : 1;
    const int64_t chunks = (kvh + per_task - 1) / per_task, tasks = seqs * chunks;
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
        if (task >= tasks) continue;
        const int64_t h0 = (task % chunks) * per_task;
        decode(a, task / chunks, h0, std::min(kvh, h0 + per_task), buf);
      }
    });
  });
}

}  // namespace core_cpu
