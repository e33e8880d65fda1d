// out = x @ w^T returned in float32 from bf16/fp16/fp32 operands: the LM head of a bf16 model.
//
// torch's bf16 GEMM rounds its result to bf16 (logits of magnitude 16-32 then move in steps
// of 0.125), and at one activation row oneDNN's GEMV reads the weight at a fraction of memory
// bandwidth. This kernel accumulates in fp32, returns fp32, and streams the weight once per
// tile of activation rows. Tiles: 4 weight rows x up to 4 activation rows, one fp32 vector
// accumulator each; with AVX512-BF16 a vdpbf16ps multiplies 32 bf16 pairs per instruction.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "isa.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace core_cpu {

inline float to_f32(c10::Half v) { return static_cast<float>(v); }

namespace {

constexpr int64_t kRowsPerTile = 4;  // activation rows (M) per tile
constexpr int64_t kColsPerTile = 4;  // weight rows (N) per tile
constexpr int64_t kPrefetchTiles = 4;  // how far ahead the weight rows are prefetched

// Portable tile: plain loops over fp32 copies of the rows (the dot helper vectorises).
template <typename T>
void tile_generic(float* out, int64_t ldo, const T* x, const T* w, int64_t mt, int64_t nt, int64_t k,
                  float* scratch) {
  float* xf = scratch;           // [mt, k]
  float* wf = scratch + mt * k;  // [k]
  for (int64_t m = 0; m < mt; ++m)
    for (int64_t i = 0; i < k; ++i) xf[m * k + i] = to_f32(x[m * k + i]);
  for (int64_t n = 0; n < nt; ++n) {
    for (int64_t i = 0; i < k; ++i) wf[i] = to_f32(w[n * k + i]);
    for (int64_t m = 0; m < mt; ++m) out[m * ldo + n] = dot(xf + m * k, wf, k);
  }
}

#if defined(__AVX512BF16__)
// MT x NT outputs with vdpbf16ps over 32-element chunks; k % 32 == 0.
template <int MT, int NT>
void tile_bf16(float* out, int64_t ldo, const bf16_t* x, const bf16_t* w, int64_t k) {
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    __m512bh wv[NT];
    for (int n = 0; n < NT; ++n) wv[n] = (__m512bh)_mm512_loadu_si512(w + n * k + i);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + i);
      for (int n = 0; n < NT; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m * ldo + n] = _mm512_reduce_add_ps(acc[m][n]);
}

template <int NT>
void tile_bf16_rows(float* out, int64_t ldo, const bf16_t* x, const bf16_t* w, int64_t mt, int64_t k) {
  switch (mt) {
    case 4: tile_bf16<4, NT>(out, ldo, x, w, k); break;
    case 3: tile_bf16<3, NT>(out, ldo, x, w, k); break;
    case 2: tile_bf16<2, NT>(out, ldo, x, w, k); break;
    default: tile_bf16<1, NT>(out, ldo, x, w, k); break;
  }
}
#endif

// One tile of up to 4 x 4 outputs (out points at [m0, n0]).
template <typename T>
void tile(float* out, int64_t ldo, const T* x, const T* w, int64_t mt, int64_t nt, int64_t k, float* scratch) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (k % 32 == 0 && active_isa() == Isa::kAvx512) {  // a forced lower path takes the portable tile
      if (nt == kColsPerTile) {
        tile_bf16_rows<4>(out, ldo, x, w, mt, k);
      } else {
        for (int64_t n = 0; n < nt; ++n) tile_bf16_rows<1>(out + n, ldo, x, w + n * k, mt, k);
      }
      return;
    }
  }
#endif
  tile_generic(out, ldo, x, w, mt, nt, k, scratch);
}

}  // namespace

// out [M, N] float32 = x [M, K] @ weight [N, K]^T; x and weight contiguous, one dtype.
void linear_f32out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && weight.size(1) == k && x.is_contiguous()
              && weight.is_contiguous() && x.scalar_type() == weight.scalar_type(),
              "linear_f32out: x [M, K] and weight [N, K] must be contiguous, one dtype; got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == m && out.size(1) == n
              && out.stride(1) == 1, "linear_f32out: out must be float32 [", m, ", ", n, "] with unit column stride");
  const int64_t ldo = out.stride(0);
  float* op = out.data_ptr<float>();
  const int64_t col_tiles = (n + kColsPerTile - 1) / kColsPerTile;
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());
    const T* wp = reinterpret_cast<const T*>(weight.data_ptr());
    // Tasks are column tiles: each streams its weight rows once for every activation row.
    at::parallel_for(0, col_tiles, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(static_cast<size_t>((kRowsPerTile + 1) * k));
      for (int64_t ct = begin; ct < end; ++ct) {
        const int64_t n0 = ct * kColsPerTile, nt = std::min(kColsPerTile, n - n0);
        if (ct + kPrefetchTiles < end) {  // few activation rows: memory-bound, fetch ahead
          const char* ahead = reinterpret_cast<const char*>(wp + (n0 + kPrefetchTiles * kColsPerTile) * k);
          for (int64_t b = 0; b < kColsPerTile * k * static_cast<int64_t>(sizeof(T)); b += 64)
            __builtin_prefetch(ahead + b);
        }
        for (int64_t m0 = 0; m0 < m; m0 += kRowsPerTile) {
          tile(op + m0 * ldo + n0, ldo, xp + m0 * k, wp + n0 * k, std::min(kRowsPerTile, m - m0), nt, k,
               scratch.data());
        }
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(bf16_t{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "linear_f32out: unsupported dtype ", x.scalar_type());
  }
}

}  // namespace core_cpu
