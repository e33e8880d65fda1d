// Weight-quantized matmuls per ISA path (see quant_gemm.h for the formats and modes).
//
// Each path computes tiles of MT activation rows x NT weight rows with one accumulator per
// output, so a weight group is unpacked once for MT rows and an activation group loaded once
// for NT weight rows. The AVX2 and NEON functions carry target attributes: they compile in
// any build of their architecture and are called only when isa.cpp found the instructions.
#include "quant_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CORE_X86 1
#define CORE_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#define CORE_ARM 1
#define CORE_NEON_DOT __attribute__((target("arch=armv8.2-a+dotprod")))
#endif

namespace core_cpu {

namespace {

int64_t groups_of(int64_t k) { return k / kQuantGroup; }

// ---- portable paths: the reference every other path is tested against -------------------

void weight_group(const QuantWeights& w, int64_t row, int64_t g, float* out) {
  const int64_t groups = groups_of(w.k);
  const float sc = scale_of(w, row * groups + g);
  if (w.bits == 4) {
    const uint8_t* c = w.codes + row * (w.k / 2) + g * 16;
    const float mn = min_of(w, row * groups + g);
    for (int j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(c[j] & 15) * sc + mn;
      out[j + 16] = static_cast<float>(c[j] >> 4) * sc + mn;
    }
  } else {
    const int8_t* c = reinterpret_cast<const int8_t*>(w.codes) + row * w.k + g * kQuantGroup;
    for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(c[j]) * sc;
  }
}

void gemm_f32_generic(float* out, int64_t ldo, const float* x, int64_t ldx, int64_t m0, int64_t m1,
                      const QuantWeights& w, int64_t n0, int64_t n1) {
  float wg[kQuantGroup];
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = m0; m < m1; ++m) out[m * ldo + n] = 0.f;
    for (int64_t g = 0; g < groups_of(w.k); ++g) {
      weight_group(w, n, g, wg);
      for (int64_t m = m0; m < m1; ++m) {
        const float* xr = x + m * ldx + g * kQuantGroup;
        float part = 0.f;
        for (int j = 0; j < kQuantGroup; ++j) part += wg[j] * xr[j];
        out[m * ldo + n] += part;
      }
    }
  }
}

int weight_code(const QuantWeights& w, int64_t row, int64_t g, int j) {
  if (w.bits == 4) {
    const uint8_t b = w.codes[row * (w.k / 2) + g * 16 + (j & 15)];
    return j < 16 ? (b & 15) : (b >> 4);
  }
  return reinterpret_cast<const int8_t*>(w.codes)[row * w.k + g * kQuantGroup + j];
}

void gemm_int8_generic(float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t m1, const QuantWeights& w,
                       int64_t n0, int64_t n1) {
  const int64_t groups = groups_of(w.k);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int j = 0; j < kQuantGroup; ++j) dot += weight_code(w, n, g, j) * x.q[m * w.k + g * kQuantGroup + j];
        acc += static_cast<float>(dot) * (scale_of(w, n * groups + g) * x.d[m * groups + g]);
        if (w.bits == 4) acc += min_of(w, n * groups + g) * x.s[m * groups + g];
      }
      out[m * ldo + n] = acc;
    }
  }
}

// Scale, codes and code sum of one group; the AVX2 path rounds identically (same products,
// round-to-nearest-even), so every path sees the same activation codes.
void quantize_group_generic(const float* x, int8_t* q, float* d, float* s) {
  float amax = 0.f;
  for (int j = 0; j < kQuantGroup; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float scale = amax / 127.f, inv = amax > 0.f ? 1.f / scale : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < kQuantGroup; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * inv));
    q[j] = static_cast<int8_t>(std::clamp(v, -127, 127));
    sum += q[j];
  }
  *d = scale;
  *s = scale * static_cast<float>(sum);
}

// ---- x86-64: AVX2 + FMA + F16C ---------------------------------------------------------------
#if defined(CORE_X86)

CORE_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The scale (or min) at index i, F16C's conversion for float16 ones.
CORE_AVX2 inline float param_avx2(const void* p, bool half, int64_t i) {
  return half ? _cvtsh_ss(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// For NT consecutive weight rows from row0: the row's mins (float16 when HALF) dotted with
// b[0, groups): per row 8-lane FMAs, hsum8, then the tail one by one (the order every earlier
// version used, so results keep their bits), the rows interleaved: b is loaded once for all.
template <int NT, bool HALF>
CORE_AVX2 inline void mins_dot_avx2(const QuantWeights& w, int64_t row0, const float* b, int64_t groups,
                                    float out[NT]) {
  auto at = [&](int r, int64_t i) { return (row0 + r) * groups + i; };
  __m256 acc[NT];
  for (int r = 0; r < NT; ++r) acc[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= groups; i += 8) {
    const __m256 bv = _mm256_loadu_ps(b + i);
    for (int r = 0; r < NT; ++r) {
      const __m256 p = HALF ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                  static_cast<const uint16_t*>(w.mins) + at(r, i))))
                            : _mm256_loadu_ps(static_cast<const float*>(w.mins) + at(r, i));
      acc[r] = _mm256_fmadd_ps(p, bv, acc[r]);
    }
  }
  for (int r = 0; r < NT; ++r) {
    float s = hsum8(acc[r]);
    for (int64_t j = i; j < groups; ++j) {
      const float p = HALF ? _cvtsh_ss(static_cast<const uint16_t*>(w.mins)[at(r, j)])
                           : static_cast<const float*>(w.mins)[at(r, j)];
      s += p * b[j];
    }
    out[r] = s;
  }
}

// Scales [at, at + count) (count <= 8) as floats into out.
CORE_AVX2 inline void scales8_avx2(const QuantWeights& w, int64_t at, int64_t count, float* out) {
  if (count == 8) {
    const __m256 v = w.half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                                  static_cast<const uint16_t*>(w.scales) + at)))
                            : _mm256_loadu_ps(static_cast<const float*>(w.scales) + at);
    _mm256_store_ps(out, v);
    return;
  }
  for (int64_t i = 0; i < count; ++i) out[i] = param_avx2(w.scales, w.half, at + i);
}

CORE_AVX2 void quantize_group_avx2(const float* x, int8_t* q, float* d, float* s) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float top = _mm_cvtss_f32(m), scale = top / 127.f, inv = top > 0.f ? 1.f / scale : 0.f;
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i c[4];
  for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));  // nearest even
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  const int32_t sum = static_cast<int32_t>(hsum8(_mm256_cvtepi32_ps(total)));  // |sum| <= 4064: exact
  // packs interleave 128-bit lanes; the permute puts the 32 codes back in order.
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d = scale;
  *s = scale * static_cast<float>(sum);
}

// The 32 weights of group g of `row` as four fp32 vectors.
template <int BITS>
CORE_AVX2 inline void dequant_avx2(const QuantWeights& w, int64_t row, int64_t g, __m256 out[4]) {
  const int64_t groups = groups_of(w.k);
  const __m256 sc = _mm256_set1_ps(param_avx2(w.scales, w.half, row * groups + g));
  if constexpr (BITS == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes + row * (w.k / 2) + g * 16));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, low4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    const __m256 mn = _mm256_set1_ps(param_avx2(w.mins, w.half, row * groups + g));
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j)
      out[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), sc, mn);
  } else {
    const int8_t* c = reinterpret_cast<const int8_t*>(w.codes) + row * w.k + g * kQuantGroup;
    for (int j = 0; j < 4; ++j) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * j));
      out[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), sc);
    }
  }
}

template <int BITS, int MT, int NT>
CORE_AVX2 void tile_f32_avx2(float* out, int64_t ldo, const float* x, int64_t ldx, const QuantWeights& w,
                             int64_t n0) {
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups_of(w.k); ++g) {
    for (int n = 0; n < NT; ++n) {
      __m256 wv[4];
      dequant_avx2<BITS>(w, n0 + n, g, wv);
      for (int m = 0; m < MT; ++m) {
        const float* xr = x + m * ldx + g * kQuantGroup;
        __m256 a = _mm256_mul_ps(wv[0], _mm256_loadu_ps(xr));
        __m256 b = _mm256_mul_ps(wv[1], _mm256_loadu_ps(xr + 8));
        a = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xr + 16), a);
        b = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xr + 24), b);
        acc[m][n] = _mm256_add_ps(acc[m][n], _mm256_add_ps(a, b));
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = hsum8(acc[m][n]);
}

// The 32 codes of group g of `row` in order, as bytes (int4: unsigned 0..15; int8: signed).
template <int BITS>
CORE_AVX2 inline __m256i codes_avx2(const QuantWeights& w, int64_t row, int64_t g) {
  if constexpr (BITS == 4) {
    const __m256i both = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.codes + row * (w.k / 2) + g * 16)));
    const __m256i shifted = _mm256_srlv_epi64(both, _mm256_setr_epi64x(0, 0, 4, 4));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + row * w.k + g * kQuantGroup));
  }
}

// One activation row streams every weight from memory once: the codes kPrefetchRows rows
// ahead are requested while these are multiplied (one cache line per request).
#ifndef CORE_PREFETCH_ROWS
#define CORE_PREFETCH_ROWS 16
#endif
constexpr int64_t kPrefetchRows = CORE_PREFETCH_ROWS;

// Every cache line of bytes [p, p + bytes).
inline void prefetch_span(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(start + off);
  __builtin_prefetch(start + bytes - 1);
}

// The scales (and int4 mins) of rows [row, row + rows): each one contiguous span of bytes.
inline void prefetch_params(const QuantWeights& w, int64_t row, int64_t rows) {
  const int64_t width = w.half ? 2 : 4, groups = groups_of(w.k);
  for (const void* p : {w.scales, w.mins})
    if (p != nullptr) prefetch_span(static_cast<const char*>(p) + row * groups * width, rows * groups * width);
}

template <int BITS, int MT, int NT>
CORE_AVX2 void tile_int8_avx2(float* out, int64_t ldo, const QuantActs& x, int64_t m0, const QuantWeights& w,
                              int64_t n0) {
  const int64_t groups = groups_of(w.k), k = w.k;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm256_setzero_ps();
  alignas(32) float sc[NT][8];  // the scales of 8 groups, converted 8 at a time (float16 ones)
  if (MT == 1) {
    prefetch_span(w.codes + (n0 + kPrefetchRows) * (BITS == 4 ? w.k / 2 : w.k), NT * (BITS == 4 ? w.k / 2 : w.k));
    prefetch_params(w, n0 + kPrefetchRows, NT);
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 8 == 0) {
      for (int n = 0; n < NT; ++n) scales8_avx2(w, (n0 + n) * groups + g, std::min<int64_t>(8, groups - g), sc[n]);
    }
    __m256i wv[NT];
    __m256 ws[NT];  // broadcast once per group, multiplied by each row's scale as vectors
    for (int n = 0; n < NT; ++n) {
      wv[n] = codes_avx2<BITS>(w, n0 + n, g);
      ws[n] = _mm256_broadcast_ss(&sc[n][g % 8]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + m) * k + g * kQuantGroup));
      const __m256 dx = _mm256_broadcast_ss(x.d + (m0 + m) * groups + g);
      for (int n = 0; n < NT; ++n) {
        // vpmaddubsw multiplies unsigned by signed bytes: int8 weights move their sign onto x.
        const __m256i p16 = BITS == 4 ? _mm256_maddubs_epi16(wv[n], xv)
                                      : _mm256_maddubs_epi16(_mm256_abs_epi8(wv[n]), _mm256_sign_epi8(xv, wv[n]));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[m][n] = _mm256_fmadd_ps(p, _mm256_mul_ps(ws[n], dx), acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    float mins[NT];
    if constexpr (BITS == 4) {
      if (w.half) mins_dot_avx2<NT, true>(w, n0, x.s + (m0 + m) * groups, groups, mins);
      else mins_dot_avx2<NT, false>(w, n0, x.s + (m0 + m) * groups, groups, mins);
    }
    for (int n = 0; n < NT; ++n) {
      float v = hsum8(acc[m][n]);
      if constexpr (BITS == 4) v += mins[n];
      out[(m0 + m) * ldo + n0 + n] = v;
    }
  }
}

// Rows [m0, m1) x columns [n0, n1) in tiles: NT weight rows (4 at one activation row, where
// the weights stream from memory; 2 otherwise) by up to 4 activation rows.
template <int BITS, int NT, typename Tile>
CORE_AVX2 void tiles_avx2(int64_t m0, int64_t m1, int64_t n0, int64_t n1, Tile&& tile) {
  int64_t n = n0;
  for (; n + NT <= n1; n += NT) {
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) tile(std::integral_constant<int, 4>{}, std::integral_constant<int, NT>{}, m, n);
    switch (m1 - m) {
      case 3: tile(std::integral_constant<int, 3>{}, std::integral_constant<int, NT>{}, m, n); break;
      case 2: tile(std::integral_constant<int, 2>{}, std::integral_constant<int, NT>{}, m, n); break;
      case 1: tile(std::integral_constant<int, 1>{}, std::integral_constant<int, NT>{}, m, n); break;
      default: break;
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) tile(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, m, n);
}

// ---- many rows: panels of weight columns unpacked once, reused by every row -----------------
// The tile kernel above unpacks a weight group for at most 4 rows and converts and scales each
// output's 8 partial sums on its own: 4-5 vector ops per 32 multiply-adds on the ports the
// fp32 FMAs use, so oneDNN's fp32 GEMM wins from ~128 rows. Here the codes of kPanelCols = 8
// weight rows are unpacked once into a panel for every row of the block, transposed so that
// one vector holds 4 consecutive codes of each of the 8 columns: vpmaddubsw of it with 4
// activation codes broadcast (a plain load) gives 8 columns' pair sums at once, so the whole
// group's products come from 8 vpmaddubsw and 8 16-bit adds per row and 8 columns, and one
// conversion, scale and FMA finish the 8 outputs.
//   int4: codes 0..15, a 16-bit lane sums 16 products <= 16 * 15 * 127 = 30,480: no overflow;
//   int8: |code| times the activation with the code's sign (vpsignb), whose pair sums
//         (<= 32,258) go to 32 bits (vpmaddwd) before they are added.

constexpr int kPanelCols = 8;

// The panel of columns [n0, n0 + cols) (cols <= kPanelCols; the rest zero, never stored).
// For group g and k-quad j (codes 4j..4j+3 of the group): codes[(g * 8 + j) * 32 + 4c + t] is
// column c's code 4j + t (int8: its absolute value); signs likewise the int8 codes themselves;
// scales[g * 8 + c], mins[g * 8 + c] as floats.
struct Panel {
  uint8_t* codes;
  int8_t* signs;
  float* scales;
  float* mins;
};

// out[j] = dword j of each of r[0..7] (an 8 x 8 transpose of 32-bit elements).
CORE_AVX2 inline void transpose8_epi32(const __m256i r[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // columns 4h..4h+3
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

template <int BITS>
CORE_AVX2 Panel fill_panel_avx2(const QuantWeights& w, int64_t n0, int cols, std::vector<uint8_t>& buf) {
  const int64_t groups = groups_of(w.k), code_bytes = groups * kPanelCols * 32, param_bytes = groups * kPanelCols * 4;
  const size_t need = static_cast<size_t>(code_bytes * (BITS == 8 ? 2 : 1) + 2 * param_bytes + 32);
  if (buf.size() < need) buf.resize(need);
  uint8_t* base = buf.data() + ((32 - reinterpret_cast<uintptr_t>(buf.data()) % 32) % 32);
  Panel p{base, reinterpret_cast<int8_t*>(base + code_bytes), nullptr, nullptr};
  p.scales = reinterpret_cast<float*>(base + code_bytes * (BITS == 8 ? 2 : 1));
  p.mins = p.scales + groups * kPanelCols;
  // First each weight row in order (one sequential stream at a time, which the hardware
  // prefetcher follows: a decode batch reads the weights from memory), its codes unpacked into
  // the panel's place for them; then every group's 8 x 8 block transposed in place.
  __m256i* panel = reinterpret_cast<__m256i*>(p.codes);
  for (int c = 0; c < kPanelCols; ++c) {
    const bool real = c < cols;
    for (int64_t g = 0; g < groups; ++g) {
      _mm256_store_si256(panel + g * kPanelCols + c, real ? codes_avx2<BITS>(w, n0 + c, g) : _mm256_setzero_si256());
      p.scales[g * kPanelCols + c] = real ? param_avx2(w.scales, w.half, (n0 + c) * groups + g) : 0.f;
      p.mins[g * kPanelCols + c] = real && BITS == 4 ? param_avx2(w.mins, w.half, (n0 + c) * groups + g) : 0.f;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m256i r[kPanelCols], t[kPanelCols];
    for (int c = 0; c < kPanelCols; ++c) r[c] = _mm256_load_si256(panel + g * kPanelCols + c);
    transpose8_epi32(r, t);
    __m256i* dst = reinterpret_cast<__m256i*>(p.codes) + g * kPanelCols;
    for (int j = 0; j < kPanelCols; ++j) {
      if constexpr (BITS == 8) {
        _mm256_store_si256(dst + j, _mm256_abs_epi8(t[j]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(p.signs) + g * kPanelCols + j, t[j]);
      } else {
        _mm256_store_si256(dst + j, t[j]);
      }
    }
  }
  return p;
}

// Rows [m0, m0 + MT) x the panel's 8 columns; stores the first `cols`.
template <int BITS, int MT>
CORE_AVX2 void panel_rows_avx2(float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t k, const Panel& p,
                               int64_t n0, int cols) {
  const int64_t groups = k / kQuantGroup;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i* wq = reinterpret_cast<const __m256i*>(p.codes) + g * kPanelCols;
    const __m256i* sq = reinterpret_cast<const __m256i*>(p.signs) + g * kPanelCols;
    __m256i sum[MT];  // int4: 16-bit pair sums; int8: 32-bit sums
    for (int m = 0; m < MT; ++m) sum[m] = _mm256_setzero_si256();
    for (int j = 0; j < kPanelCols; ++j) {
      const __m256i wv = _mm256_load_si256(wq + j);
      for (int m = 0; m < MT; ++m) {
        // vbroadcastss from memory: a load-port uop only (a broadcast from a register would
        // take the shuffle port the horizontal work needs).
        const __m256i xb = _mm256_castps_si256(
            _mm256_broadcast_ss(reinterpret_cast<const float*>(x.q + (m0 + m) * k + g * kQuantGroup + 4 * j)));
        if constexpr (BITS == 4) {
          sum[m] = _mm256_add_epi16(sum[m], _mm256_maddubs_epi16(wv, xb));
          // Keeps the sums in registers: left free, GCC reassociates the 8 adds into a tree
          // after all 32 products and spills them (16 vector registers on AVX2).
          asm("" : "+x"(sum[m]));
        } else {
          const __m256i p16 = _mm256_maddubs_epi16(wv, _mm256_sign_epi8(xb, _mm256_load_si256(sq + j)));
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(p16, ones));
          asm("" : "+x"(sum[m]));
        }
      }
    }
    const __m256 sc = _mm256_load_ps(p.scales + g * kPanelCols);
    for (int m = 0; m < MT; ++m) {
      const int64_t row = m0 + m;
      const __m256i dot = BITS == 4 ? _mm256_madd_epi16(sum[m], ones) : sum[m];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_broadcast_ss(x.d + row * groups + g)),
                               acc[m]);
      if constexpr (BITS == 4)
        acc[m] = _mm256_fmadd_ps(_mm256_load_ps(p.mins + g * kPanelCols), _mm256_broadcast_ss(x.s + row * groups + g),
                                 acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float* o = out + (m0 + m) * ldo + n0;
    if (cols == kPanelCols) {
      _mm256_storeu_ps(o, acc[m]);
    } else {
      alignas(32) float v[kPanelCols];
      _mm256_store_ps(v, acc[m]);
      for (int c = 0; c < cols; ++c) o[c] = v[c];
    }
  }
}

template <int BITS>
CORE_AVX2 void gemm_int8_panels_avx2(float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t m1,
                                     const QuantWeights& w, int64_t n0, int64_t n1) {
  thread_local std::vector<uint8_t> buf;  // one panel per thread, reused by every call
  for (int64_t n = n0; n < n1; n += kPanelCols) {
    const int cols = static_cast<int>(std::min<int64_t>(kPanelCols, n1 - n));
    const Panel p = fill_panel_avx2<BITS>(w, n, cols, buf);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) panel_rows_avx2<BITS, 4>(out, ldo, x, m, w.k, p, n, cols);
    switch (m1 - m) {
      case 3: panel_rows_avx2<BITS, 3>(out, ldo, x, m, w.k, p, n, cols); break;
      case 2: panel_rows_avx2<BITS, 2>(out, ldo, x, m, w.k, p, n, cols); break;
      case 1: panel_rows_avx2<BITS, 1>(out, ldo, x, m, w.k, p, n, cols); break;
      default: break;
    }
  }
}

template <int BITS>
CORE_AVX2 void gemm_f32_avx2(float* out, int64_t ldo, const float* x, int64_t ldx, int64_t m0, int64_t m1,
                             const QuantWeights& w, int64_t n0, int64_t n1) {
  auto tile = [&](auto mt, auto nt, int64_t m, int64_t n) {
    tile_f32_avx2<BITS, decltype(mt)::value, decltype(nt)::value>(out + m * ldo + n, ldo, x + m * ldx, ldx, w, n);
  };
  if (m1 - m0 == 1) tiles_avx2<BITS, 4>(m0, m1, n0, n1, tile);
  else tiles_avx2<BITS, 2>(m0, m1, n0, n1, tile);
}

template <int BITS>
CORE_AVX2 void gemm_int8_avx2(float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t m1,
                              const QuantWeights& w, int64_t n0, int64_t n1) {
  auto tile = [&](auto mt, auto nt, int64_t m, int64_t n) {
    tile_int8_avx2<BITS, decltype(mt)::value, decltype(nt)::value>(out, ldo, x, m, w, n);
  };
  if (m1 - m0 == 1) tiles_avx2<BITS, 4>(m0, m1, n0, n1, tile);
  else tiles_avx2<BITS, 2>(m0, m1, n0, n1, tile);
}

#endif  // CORE_X86

// ---- AArch64: NEON with sdot -----------------------------------------------------------------
#if defined(CORE_ARM)

template <int BITS>
CORE_NEON_DOT inline void codes_neon(const QuantWeights& w, int64_t row, int64_t g, int8x16_t& lo, int8x16_t& hi) {
  if constexpr (BITS == 4) {
    const uint8x16_t raw = vld1q_u8(w.codes + row * (w.k / 2) + g * 16);
    lo = vreinterpretq_s8_u8(vandq_u8(raw, vdupq_n_u8(0x0F)));  // elements 0..15
    hi = vreinterpretq_s8_u8(vshrq_n_u8(raw, 4));               // elements 16..31
  } else {
    const int8_t* c = reinterpret_cast<const int8_t*>(w.codes) + row * w.k + g * kQuantGroup;
    lo = vld1q_s8(c);
    hi = vld1q_s8(c + 16);
  }
}

template <int BITS, int MT, int NT>
CORE_NEON_DOT void tile_int8_neon(float* out, int64_t ldo, const QuantActs& x, int64_t m0, const QuantWeights& w,
                                  int64_t n0) {
  const int64_t groups = groups_of(w.k), k = w.k;
  float32x4_t acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = vdupq_n_f32(0.f);
  for (int64_t g = 0; g < groups; ++g) {
    int8x16_t lo[NT], hi[NT];
    for (int n = 0; n < NT; ++n) codes_neon<BITS>(w, n0 + n, g, lo[n], hi[n]);
    for (int m = 0; m < MT; ++m) {
      const int8_t* xq = x.q + (m0 + m) * k + g * kQuantGroup;
      const int8x16_t x0 = vld1q_s8(xq), x1 = vld1q_s8(xq + 16);
      const float dx = x.d[(m0 + m) * groups + g];
      for (int n = 0; n < NT; ++n) {
        const int32x4_t p = vdotq_s32(vdotq_s32(vdupq_n_s32(0), lo[n], x0), hi[n], x1);
        acc[m][n] = vfmaq_n_f32(acc[m][n], vcvtq_f32_s32(p), scale_of(w, (n0 + n) * groups + g) * dx);
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    for (int n = 0; n < NT; ++n) {
      float v = vaddvq_f32(acc[m][n]);
      if constexpr (BITS == 4) {
        for (int64_t g = 0; g < groups; ++g) v += min_of(w, (n0 + n) * groups + g) * x.s[(m0 + m) * groups + g];
      }
      out[(m0 + m) * ldo + n0 + n] = v;
    }
  }
}

template <int BITS>
CORE_NEON_DOT void gemm_int8_neon(float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t m1,
                                  const QuantWeights& w, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) tile_int8_neon<BITS, 2, 4>(out, ldo, x, m, w, n);
    if (m < m1) tile_int8_neon<BITS, 1, 4>(out, ldo, x, m, w, n);
  }
  for (; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) tile_int8_neon<BITS, 1, 1>(out, ldo, x, m, w, n);
}

#endif  // CORE_ARM

}  // namespace

void quantize_rows(Isa isa, const float* x, int64_t ldx, int64_t k, int64_t m0, int64_t m1, int8_t* q, float* d,
                   float* s) {
  const int64_t groups = groups_of(k);
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + m * ldx + g * kQuantGroup;
      int8_t* dq = q + m * k + g * kQuantGroup;
      float *dd = d + m * groups + g, *ds = s + m * groups + g;
#if defined(CORE_X86)
      if (isa == Isa::kAvx2 || isa == Isa::kAvx512) {
        quantize_group_avx2(src, dq, dd, ds);
        continue;
      }
#endif
      (void)isa;
      quantize_group_generic(src, dq, dd, ds);
    }
  }
}

// The AVX-512 path uses the AVX2 kernels here (no 512-bit versions of these are written).
void quant_gemm_f32(Isa isa, float* out, int64_t ldo, const float* x, int64_t ldx, int64_t m0, int64_t m1,
                    const QuantWeights& w, int64_t n0, int64_t n1) {
#if defined(CORE_X86)
  if (isa == Isa::kAvx2 || isa == Isa::kAvx512) {
    if (w.bits == 4) gemm_f32_avx2<4>(out, ldo, x, ldx, m0, m1, w, n0, n1);
    else gemm_f32_avx2<8>(out, ldo, x, ldx, m0, m1, w, n0, n1);
    return;
  }
#endif
  (void)isa;
  gemm_f32_generic(out, ldo, x, ldx, m0, m1, w, n0, n1);
}

void quant_gemm_int8(Isa isa, float* out, int64_t ldo, const QuantActs& x, int64_t m0, int64_t m1,
                     const QuantWeights& w, int64_t n0, int64_t n1, Int8Kernel kernel) {
#if defined(CORE_X86)
  if (isa == Isa::kAvx2 || isa == Isa::kAvx512) {
    const bool panels = kernel == Int8Kernel::kPanels || (kernel == Int8Kernel::kAuto && m1 - m0 >= (w.bits == 4 ? kPanelMinRows4 : kPanelMinRows8));
    if (panels) {
      if (w.bits == 4) gemm_int8_panels_avx2<4>(out, ldo, x, m0, m1, w, n0, n1);
      else gemm_int8_panels_avx2<8>(out, ldo, x, m0, m1, w, n0, n1);
    } else if (w.bits == 4) {
      gemm_int8_avx2<4>(out, ldo, x, m0, m1, w, n0, n1);
    } else {
      gemm_int8_avx2<8>(out, ldo, x, m0, m1, w, n0, n1);
    }
    return;
  }
#endif
  (void)kernel;
#if defined(CORE_ARM)
  if (isa == Isa::kNeonDot) {
    if (w.bits == 4) gemm_int8_neon<4>(out, ldo, x, m0, m1, w, n0, n1);
    else gemm_int8_neon<8>(out, ldo, x, m0, m1, w, n0, n1);
    return;
  }
#endif
  (void)isa;
  gemm_int8_generic(out, ldo, x, m0, m1, w, n0, n1);
}

}  // namespace core_cpu
