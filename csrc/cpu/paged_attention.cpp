// Paged KV cache ops of the CPU attention backend (platforms/cpu/attention.py).
//
// Cache layout: [2, num_blocks, block_size, kv_heads, head_size] (keys, then values), so one
// slot's key is a contiguous [kv_heads, head_size] row.
//
// Decode reads each sequence's blocks straight from the cache (no gather into a padded
// copy) and, for grouped-query attention, reads every key/value row once for all the query
// heads of its group. Scores, softmax and the weighted sum are fp32 whatever the cache dtype.
// One kernel serves every cache element type C (float32, bfloat16, float16: the query's own
// dtype; or float8_e4m3fn codes, see paged_attention_fp8.cpp): it only needs C's loaders
// (to_f32, load8, load16) and reads keys as stored * k_scale, values as stored * v_scale. The
// key scale is folded into the pre-scaled query and the value scale into the output, so the
// inner loops only widen; for the non-fp8 caches both scales are 1, which is exact.
//
// Prompts use the same kernel: once a step's keys and values are in the cache, prompt token t
// of a sequence with c cached positions is a decode of length c + t + 1 over that sequence's
// block table, so each query row names its table row (`table_rows`) and its own length.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CORE_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

#include "cpu_math.h"
#include "isa.h"
#include "paged_attention.h"

namespace core_cpu {

using fp8_t = c10::Float8_e4m3fn;

inline float to_f32(c10::Half v) { return static_cast<float>(v); }
template <>
inline c10::Half from_f32<c10::Half>(float v) {
  return c10::Half(v);
}

// e4m3fn code -> float, exact for every finite code. Built from normal floats only (the
// mantissa as a small integer times a power of two), so a process that flushes denormals
// (DAZ/FTZ) still reads subnormal codes right; branch-free, so row loops vectorise. The NaN
// codes (0x7f, 0xff) never occur in a cache write_kv_fp8 filled from finite values.
inline float to_f32(fp8_t v) {
  const uint32_t b = v.x, e = (b >> 3) & 15u, m = b & 7u;
  const uint32_t mant = e ? (m | 8u) : m;             // 1.mmm as an integer, or 0.mmm
  const uint32_t pow2 = ((e ? e : 1u) + 117u) << 23;  // 2^(max(e, 1) - 10)
  const float f = static_cast<float>(mant) * bits_to_float(pow2);
  return (b & 0x80u) ? -f : f;
}

// Query/output element types (a cache of one of these holds the query's dtype).
template <typename F>
void dispatch_cache_types(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16_t{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

void check_cache(const at::Tensor& kv_cache, const char* op) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(), op,
              ": kv_cache must be a contiguous [2, blocks, block_size, kv_heads, head_size] tensor, got ",
              kv_cache.sizes());
}

// [tokens, heads, head_size] with each token's heads one contiguous row (any token stride).
void check_head_rows(const at::Tensor& t, int64_t heads, int64_t d, const char* op, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(1) == heads && t.size(2) == d && t.stride(2) == 1 && t.stride(1) == d,
              op, " ", what, " must be [tokens, ", heads, ", ", d, "] with contiguous heads, got sizes ", t.sizes(),
              " strides ", t.strides());
}

KvWrite check_kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                       const at::Tensor& slots, const char* op) {
  check_cache(kv_cache, op);
  const int64_t kvh = kv_cache.size(3), d = kv_cache.size(4);
  const KvWrite w{kvh * d, kv_cache.size(1) * kv_cache.size(2), key.size(0), nullptr};
  check_head_rows(key, kvh, d, op, "key");
  check_head_rows(value, kvh, d, op, "value");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == w.tokens
              && value.size(0) == w.tokens, op, ": slot_mapping must be contiguous int64 [tokens]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < w.tokens; ++t) {
    TORCH_CHECK(sp[t] < w.num_slots, op, ": slot ", sp[t], " is outside the cache's ", w.num_slots, " slots");
  }
  return {w.row, w.num_slots, w.tokens, sp};
}

void for_each_written_slot(const KvWrite& w, int64_t grain, const std::function<void(int64_t, int64_t)>& store) {
  at::parallel_for(0, w.tokens, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (w.slots[t] >= 0) store(t, w.slots[t]);
    }
  });
}

// Stores key/value rows at their slots; negative slots are padding and skipped.
void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const at::Tensor& slots) {
  const KvWrite w = check_kv_write(key, value, kv_cache, slots, "write_kv");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv: key/value dtype must be the cache's");
  const int64_t es = kv_cache.element_size(), bytes = w.row * es;
  char* kdst = static_cast<char*>(kv_cache.data_ptr());
  char* vdst = kdst + w.num_slots * bytes;
  const char* ksrc = static_cast<const char*>(key.data_ptr());
  const char* vsrc = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * es, vs = value.stride(0) * es;
  for_each_written_slot(w, 64, [&](int64_t t, int64_t slot) {
    std::memcpy(kdst + slot * bytes, ksrc + t * ks, bytes);
    std::memcpy(vdst + slot * bytes, vsrc + t * vs, bytes);
  });
}

// T: query/output element type; C: cache element type (T itself, or fp8_t).
template <typename T, typename C>
struct DecodeArgs {
  T* out;
  const T* query;
  int64_t out_stride, q_stride;  // elements between tokens
  const C* keys;                 // cache[0]
  const C* values;               // cache[1]
  int64_t num_blocks, block_size, kv_heads, head_size, group;
  const int32_t* tables;
  const int32_t* table_rows;  // query row -> block-table row; null: row b uses table row b
  int64_t table_stride, table_width;
  const int32_t* seq_lens;
  float scale;      // softmax scale * k_scale (the key scale folded into the query)
  float out_scale;  // v_scale, applied once to each weighted sum of stored values
  int64_t window;   // <= 0: attend to the whole context
  float soft_cap;   // <= 0: none; else scaled scores s become soft_cap * tanh(s / soft_cap)
};

// Positions [start, len) of sequence b, block by block: f(row of kv head h, position - start).
template <typename T, typename C, typename F>
inline void for_each_row(const DecodeArgs<T, C>& a, const C* base, int64_t b, int64_t h, int64_t start,
                         int64_t len, F&& f) {
  const int32_t* table = a.tables + (a.table_rows ? a.table_rows[b] : b) * a.table_stride;
  const int64_t bs = a.block_size, row_stride = a.kv_heads * a.head_size;
  for (int64_t p = start; p < len;) {
    const int64_t bi = p / bs, stop = std::min(len, (bi + 1) * bs);
    const C* rows = base + static_cast<int64_t>(table[bi]) * bs * row_stride + h * a.head_size;
    for (; p < stop; ++p) f(rows + (p - bi * bs) * row_stride, p - start);
  }
}

// Gemma 2's attention-logit soft cap on one row of scaled scores, before the softmax.
inline void soft_cap_inplace(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

inline int64_t window_start(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// One (sequence, kv head): the `group` query heads that share it. Portable version.
template <typename T, typename C>
void decode_one(const DecodeArgs<T, C>& a, int64_t b, int64_t h, std::vector<float>& buf) {
  const int64_t d = a.head_size, g_n = a.group;
  const int64_t len = a.seq_lens[b], start = window_start(len, a.window), n = len - start;
  buf.resize(static_cast<size_t>(g_n * (2 * d + n) + d));
  float* q = buf.data();       // [group, d], pre-scaled
  float* acc = q + g_n * d;    // [group, d]
  float* row = acc + g_n * d;  // [d] one key/value row in fp32
  float* scores = row + d;     // [group, n]
  for (int64_t g = 0; g < g_n; ++g) {
    const T* src = a.query + b * a.q_stride + (h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) q[g * d + i] = to_f32(src[i]) * a.scale;
  }
  for_each_row(a, a.keys, b, h, start, len, [&](const C* k, int64_t j) {
    for (int64_t i = 0; i < d; ++i) row[i] = to_f32(k[i]);
    for (int64_t g = 0; g < g_n; ++g) scores[g * n + j] = dot(q + g * d, row, d);
  });
  for (int64_t g = 0; g < g_n; ++g) {
    soft_cap_inplace(scores + g * n, n, a.soft_cap);
    softmax_inplace(scores + g * n, n);
  }
  std::fill(acc, acc + g_n * d, 0.f);
  for_each_row(a, a.values, b, h, start, len, [&](const C* v, int64_t j) {
    for (int64_t i = 0; i < d; ++i) row[i] = to_f32(v[i]);
    for (int64_t g = 0; g < g_n; ++g) {
      const float w = scores[g * n + j];
      float* ag = acc + g * d;
      for (int64_t i = 0; i < d; ++i) ag[i] += w * row[i];
    }
  });
  for (int64_t g = 0; g < g_n; ++g) {
    T* dst = a.out + b * a.out_stride + (h * g_n + g) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = from_f32<T>(acc[g * d + i] * a.out_scale);
  }
}

// Cache types with a 16-wide AVX-512 loader; an fp8 cache takes the AVX2 kernel instead.
template <typename C>
inline constexpr bool kHasLoad16 = !std::is_same_v<C, fp8_t>;

#if defined(__AVX512F__)
// AVX-512 version for head sizes of NV * 16. A task takes kv heads [h0, h1) of one sequence,
// up to kMaxQueries query heads: with all of a sequence's heads in one task, each cached
// position's keys (all heads, one contiguous row) are read once and completely, so the cache
// streams from memory in whole lines instead of a head's slice of each row per task.
constexpr int64_t kMaxQueries = 32;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T, typename C, int NV>
void decode_heads_avx512(const DecodeArgs<T, C>& a, int64_t b, int64_t h0, int64_t h1, std::vector<float>& buf) {
  constexpr int64_t D = NV * 16;
  const int64_t g_n = a.group, nq = (h1 - h0) * g_n;  // query heads of this task
  const int64_t len = a.seq_lens[b], start = window_start(len, a.window), n = len - start;
  buf.resize(static_cast<size_t>(nq * n));
  float* scores = buf.data();  // [nq, n]
  __m512 q[kMaxQueries][NV];
  const __m512 scale = _mm512_set1_ps(a.scale);
  const T* qsrc = a.query + b * a.q_stride + h0 * g_n * D;
  for (int64_t i = 0; i < nq; ++i)
    for (int v = 0; v < NV; ++v) q[i][v] = _mm512_mul_ps(load16(qsrc + i * D + 16 * v), scale);
  for_each_row(a, a.keys, b, h0, start, len, [&](const C* k, int64_t j) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      __m512 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load16(k + h * D + 16 * v);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t i = h * g_n + g;
        __m512 acc = _mm512_mul_ps(q[i][0], kv[0]);
        for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(q[i][v], kv[v], acc);
        scores[i * n + j] = _mm512_reduce_add_ps(acc);
      }
    }
  });
  for (int64_t i = 0; i < nq; ++i) {
    soft_cap_inplace(scores + i * n, n, a.soft_cap);
    softmax_inplace(scores + i * n, n);
  }
  __m512 acc[kMaxQueries][NV];
  for (int64_t i = 0; i < nq; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for_each_row(a, a.values, b, h0, start, len, [&](const C* val, int64_t j) {
    for (int64_t h = 0; h < h1 - h0; ++h) {
      __m512 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load16(val + h * D + 16 * v);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t i = h * g_n + g;
        const __m512 w = _mm512_set1_ps(scores[i * n + j]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(w, vv[v], acc[i][v]);
      }
    }
  });
  alignas(64) float tmp[D];
  const __m512 out_scale = _mm512_set1_ps(a.out_scale);
  T* dst = a.out + b * a.out_stride + h0 * g_n * D;
  for (int64_t i = 0; i < nq; ++i) {
    for (int v = 0; v < NV; ++v) _mm512_store_ps(tmp + 16 * v, _mm512_mul_ps(acc[i][v], out_scale));
    for (int64_t e = 0; e < D; ++e) dst[i * D + e] = from_f32<T>(tmp[e]);
  }
}
#endif

#if defined(CORE_AVX2)
// AVX2 + FMA + F16C version of decode_heads_avx512 (head sizes of NV * 8, up to kMaxQueries2
// query heads per task), for the CPUs most machines have. The block walk is written out
// instead of for_each_row: a lambda would not carry this function's target attribute.
constexpr int64_t kMaxQueries2 = 32;

CORE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
CORE_AVX2 inline __m256 load8(const bf16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
CORE_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 e4m3 codes -> 8 floats equal to code / 256, exactly: a code's sign, 4 exponent and 3
// mantissa bits placed as an fp16's (bias 15 instead of 7, so 2^-8 times the value; fp8
// subnormals become fp16 subnormals, which F16C converts exactly). kLoad8Scale undoes the 256.
CORE_AVX2 inline __m256 load8(const fp8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8);
  const __m128i rest = _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, rest));
}
CORE_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Stored value / what load8 returns for it: 1, except fp8 (load8 gives code / 256).
template <typename C>
inline constexpr float kLoad8Scale = 1.f;
template <>
inline constexpr float kLoad8Scale<fp8_t> = 256.f;

// Scores of positions [start, len) of sequence b for the query heads of kv heads [h0, h0 + heads).
template <typename T, typename C, int NV>
CORE_AVX2 void scores_avx2(const DecodeArgs<T, C>& a, int64_t b, int64_t h0, int64_t heads, int64_t start,
                           int64_t len, float* scores) {
  constexpr int64_t D = NV * 8;
  const int64_t g_n = a.group, nq = heads * g_n, n = len - start;
  const int32_t* table = a.tables + (a.table_rows ? a.table_rows[b] : b) * a.table_stride;
  const int64_t bs = a.block_size, row_stride = a.kv_heads * a.head_size;
  __m256 q[kMaxQueries2][NV];
  const __m256 scale = _mm256_set1_ps(a.scale * kLoad8Scale<C>);
  const T* qsrc = a.query + b * a.q_stride + h0 * g_n * D;
  for (int64_t i = 0; i < nq; ++i)
    for (int v = 0; v < NV; ++v) q[i][v] = _mm256_mul_ps(load8(qsrc + i * D + 8 * v), scale);
  for (int64_t p = start; p < len; ++p) {
    const C* k = a.keys + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row_stride + h0 * D;
    for (int64_t h = 0; h < heads; ++h) {
      __m256 kv[NV];
      for (int v = 0; v < NV; ++v) kv[v] = load8(k + h * D + 8 * v);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t i = h * g_n + g;
        __m256 acc0 = _mm256_mul_ps(q[i][0], kv[0]), acc1 = _mm256_setzero_ps();
        for (int v = 1; v < NV; v += 2) {
          acc1 = _mm256_fmadd_ps(q[i][v], kv[v], acc1);
          if (v + 1 < NV) acc0 = _mm256_fmadd_ps(q[i][v + 1], kv[v + 1], acc0);
        }
        scores[i * n + p - start] = hsum8(_mm256_add_ps(acc0, acc1));
      }
    }
  }
}

template <typename T, typename C, int NV>
CORE_AVX2 void decode_heads_avx2(const DecodeArgs<T, C>& a, int64_t b, int64_t h0, int64_t h1,
                                 std::vector<float>& buf) {
  constexpr int64_t D = NV * 8;
  const int64_t g_n = a.group, nq = (h1 - h0) * g_n, heads = h1 - h0;
  const int64_t len = a.seq_lens[b], start = window_start(len, a.window), n = len - start;
  const int32_t* table = a.tables + (a.table_rows ? a.table_rows[b] : b) * a.table_stride;
  const int64_t bs = a.block_size, row_stride = a.kv_heads * a.head_size;
  buf.resize(static_cast<size_t>(nq * n));
  float* scores = buf.data();  // [nq, n]
  scores_avx2<T, C, NV>(a, b, h0, heads, start, len, scores);
  for (int64_t i = 0; i < nq; ++i) {
    soft_cap_inplace(scores + i * n, n, a.soft_cap);
    softmax_inplace(scores + i * n, n);
  }
  __m256 acc[kMaxQueries2][NV];
  for (int64_t i = 0; i < nq; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_setzero_ps();
  for (int64_t p = start; p < len; ++p) {
    const C* val = a.values + (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * row_stride + h0 * D;
    for (int64_t h = 0; h < heads; ++h) {
      __m256 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = load8(val + h * D + 8 * v);
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t i = h * g_n + g;
        const __m256 w = _mm256_set1_ps(scores[i * n + p - start]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm256_fmadd_ps(w, vv[v], acc[i][v]);
      }
    }
  }
  alignas(32) float tmp[D];
  const __m256 out_scale = _mm256_set1_ps(a.out_scale * kLoad8Scale<C>);
  T* dst = a.out + b * a.out_stride + h0 * g_n * D;
  for (int64_t i = 0; i < nq; ++i) {
    for (int v = 0; v < NV; ++v) _mm256_store_ps(tmp + 8 * v, _mm256_mul_ps(acc[i][v], out_scale));
    for (int64_t e = 0; e < D; ++e) dst[i * D + e] = from_f32<T>(tmp[e]);
  }
}
#endif

template <typename T, typename C>
void decode_heads_generic(const DecodeArgs<T, C>& a, int64_t b, int64_t h0, int64_t h1, std::vector<float>& buf) {
  for (int64_t h = h0; h < h1; ++h) decode_one(a, b, h, buf);
}

template <typename T, typename C>
using DecodeFn = void (*)(const DecodeArgs<T, C>&, int64_t, int64_t, int64_t, std::vector<float>&);

// The routine for this head size and group, and how many kv heads one task may take.
template <typename T, typename C>
std::pair<DecodeFn<T, C>, int64_t> pick_decode(int64_t head_size, int64_t group) {
  const Isa isa = active_isa();
#if defined(__AVX512F__)
  if constexpr (kHasLoad16<C>) {
    if (isa == Isa::kAvx512 && group <= kMaxQueries) {
      if (head_size == 64) return {&decode_heads_avx512<T, C, 4>, kMaxQueries / group};
      if (head_size == 128) return {&decode_heads_avx512<T, C, 8>, kMaxQueries / group};
    }
  }
#endif
#if defined(CORE_AVX2)
  // A cache type without an AVX-512 kernel takes the AVX2 one on an AVX-512 CPU too.
  const bool avx2 = isa == Isa::kAvx2 || (!kHasLoad16<C> && isa == Isa::kAvx512);
  if (avx2 && group <= kMaxQueries2) {
    if (head_size == 64) return {&decode_heads_avx2<T, C, 8>, kMaxQueries2 / group};
    if (head_size == 128) return {&decode_heads_avx2<T, C, 16>, kMaxQueries2 / group};
    if (head_size == 96) return {&decode_heads_avx2<T, C, 12>, kMaxQueries2 / group};
    if (head_size == 32) return {&decode_heads_avx2<T, C, 4>, kMaxQueries2 / group};
  }
#endif
  (void)isa;
  (void)head_size;
  (void)group;
  return {&decode_heads_generic<T, C>, 1 << 20};
}

// Validates every index the kernel will follow, once, so the kernel can index freely: each
// query row's table row, and each table row's blocks up to its longest use.
void check_tables(const at::Tensor& block_tables, const int32_t* rows, const int32_t* lens, int64_t seqs,
                  int64_t nb, int64_t bs, const char* op) {
  const int64_t table_count = block_tables.size(0), width = block_tables.size(1);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<int64_t> used(static_cast<size_t>(table_count), 0);
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t r = rows ? rows[b] : b;
    TORCH_CHECK(r >= 0 && r < table_count, op, ": table row ", r, " of query row ", b, " is outside [0, ",
                table_count, ")");
    TORCH_CHECK(lens[b] >= 1 && (lens[b] + bs - 1) / bs <= width, op, ": query row ", b, " has length ",
                lens[b], " but its block table holds ", width, " blocks of ", bs);
    used[r] = std::max<int64_t>(used[r], (lens[b] + bs - 1) / bs);
  }
  for (int64_t r = 0; r < table_count; ++r) {
    for (int64_t i = 0; i < used[r]; ++i) {
      const int32_t blk = tables[r * block_tables.stride(0) + i];
      TORCH_CHECK(blk >= 0 && blk < nb, op, ": block ", blk, " of table row ", r, " is outside [0, ", nb, ")");
    }
  }
}

// Checks the query/out/table/length arguments of a decode; returns table_rows' data or null.
const int32_t* check_decode_args(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 const std::optional<at::Tensor>& table_rows, double logits_soft_cap,
                                 const char* op) {
  check_cache(kv_cache, op);
  TORCH_CHECK(logits_soft_cap >= 0.0, op, ": logits_soft_cap ", logits_soft_cap,
              " must be 0 (no capping) or positive");
  const int64_t seqs = query.size(0), heads = query.size(1), kvh = kv_cache.size(3), d = kv_cache.size(4);
  check_head_rows(query, heads, d, op, "query");
  check_head_rows(out, heads, d, op, "out");
  TORCH_CHECK(heads % kvh == 0, op, ": ", heads, " query heads are not a multiple of ", kvh, " kv heads");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), op, ": out dtype ", out.scalar_type(),
              " must be the query's ", query.scalar_type());
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat8_e4m3fn || query.scalar_type() == kv_cache.scalar_type(), op,
              ": query dtype ", query.scalar_type(), " must be the cache's ", kv_cache.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.scalar_type() == at::kInt
              && (table_rows.has_value() || block_tables.size(0) == seqs),
              op, ": block_tables must be int32 [seqs, blocks] (or any rows with table_rows)");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.numel() == seqs && seq_lens.scalar_type() == at::kInt, op,
              ": seq_lens must be contiguous int32 [rows]");
  const int32_t* rows = nullptr;
  if (table_rows.has_value()) {
    TORCH_CHECK(table_rows->is_contiguous() && table_rows->numel() == seqs && table_rows->scalar_type() == at::kInt,
                op, ": table_rows must be contiguous int32 [rows]");
    rows = table_rows->data_ptr<int32_t>();
  }
  check_tables(block_tables, rows, seq_lens.data_ptr<int32_t>(), seqs, kv_cache.size(1), kv_cache.size(2), op);
  return rows;
}

// Runs the decode of every (query row, kv head) over the threads.
template <typename T, typename C>
void run_decode(const DecodeArgs<T, C>& a, int64_t seqs) {
  const int64_t kvh = a.kv_heads;
  const auto [decode, max_heads] = pick_decode<T, C>(a.head_size, a.group);
  // Whole sequences per task when there are enough of them to keep every thread busy;
  // otherwise one kv head per task, so a lone long sequence still uses all threads.
  const int64_t per_task = seqs >= at::get_num_threads() ? std::min(kvh, max_heads) : 1;
  const int64_t chunks = (kvh + per_task - 1) / per_task, tasks = seqs * chunks;
  // parallel_for gives each thread one contiguous range, but the rows of a prompt grow
  // longer down the batch. Deal the tasks out block-cyclically instead: kSpread blocks of
  // consecutive tasks per thread, from all over the batch (balance), each block still a
  // run of neighbouring rows that read the same keys (cache locality).
  constexpr int64_t kSpread = 8;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  const int64_t block = std::max<int64_t>(1, tasks / (threads * kSpread));
  const int64_t blocks = (tasks + block - 1) / block;
  const int64_t blocks_per_thread = (blocks + threads - 1) / threads;
  at::parallel_for(0, blocks_per_thread * threads * block, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / block;  // dealt block -> batch block: a bijection
      const int64_t task = ((b % blocks_per_thread) * threads + b / blocks_per_thread) * block + i % block;
      if (task >= tasks) continue;
      const int64_t h0 = (task % chunks) * per_task;
      decode(a, task / chunks, h0, std::min(kvh, h0 + per_task), buf);
    }
  });
}

void paged_decode_scaled(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                         const std::optional<at::Tensor>& table_rows, double logits_soft_cap, double k_scale,
                         double v_scale, const char* op) {
  const int32_t* rows =
      check_decode_args(out, query, kv_cache, block_tables, seq_lens, table_rows, logits_soft_cap, op);
  const int64_t seqs = query.size(0), heads = query.size(1);
  const int64_t nb = kv_cache.size(1), bs = kv_cache.size(2), kvh = kv_cache.size(3), d = kv_cache.size(4);
  auto run = [&](auto query_tag, auto cache_tag) {
    using T = decltype(query_tag);
    using C = decltype(cache_tag);
    const C* keys = reinterpret_cast<const C*>(kv_cache.data_ptr());
    const DecodeArgs<T, C> a{reinterpret_cast<T*>(out.data_ptr()), reinterpret_cast<const T*>(query.data_ptr()),
                             out.stride(0), query.stride(0), keys, keys + nb * bs * kvh * d, nb, bs, kvh, d,
                             heads / kvh, block_tables.data_ptr<int32_t>(), rows, block_tables.stride(0),
                             block_tables.size(1), seq_lens.data_ptr<int32_t>(),
                             static_cast<float>(scale * k_scale), static_cast<float>(v_scale), window,
                             static_cast<float>(logits_soft_cap)};
    run_decode(a, seqs);
  };
  dispatch_cache_types(query.scalar_type(), op, [&](auto tag) {
    if (kv_cache.scalar_type() == at::kFloat8_e4m3fn) {
      run(tag, fp8_t{});
    } else {
      run(tag, tag);
    }
  });
}

// out[b] = softmax(scale * q[b] K^T) V over the first seq_lens[b] positions of block-table
// row table_rows[b] (row b without table_rows), the last `window` of them when window > 0;
// scores soft-capped (cap * tanh(s / cap)) when logits_soft_cap > 0.
// query/out: [rows, heads, head_size], of the cache's dtype.
void paged_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                  const std::optional<at::Tensor>& table_rows, double logits_soft_cap) {
  TORCH_CHECK(kv_cache.scalar_type() != at::kFloat8_e4m3fn,
              "paged_decode: a float8_e4m3fn cache needs its scales; call paged_decode_fp8");
  paged_decode_scaled(out, query, kv_cache, block_tables, seq_lens, scale, window, table_rows, logits_soft_cap, 1.0,
                      1.0, "paged_decode");
}

}  // namespace core_cpu
