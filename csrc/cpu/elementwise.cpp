// Fused element-wise ops of a decoder layer on CPU: RMSNorm (with the residual add),
// SiLU-and-multiply, and neox rotary embedding.
//
// Each op writes into outputs the caller allocated and rounds exactly where the torch
// reference in core/ops.py rounds (the residual sum, silu(gate), the product are rounded to
// the tensor dtype; norms and rotations are computed in fp32), so a bf16 model sees the same
// values up to fp32 summation order. Rows are split across torch's intra-op threads.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <cmath>

#include "cpu_math.h"

namespace core_cpu {

inline float to_f32(c10::Half v) { return static_cast<float>(v); }
template <>
inline c10::Half from_f32<c10::Half>(float v) {
  return c10::Half(v);
}

// Calls f(T{}) with T the kernel element type of `t` (bf16_t for bfloat16).
template <typename F>
void dispatch_float_types(at::ScalarType t, const char* op, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(bf16_t{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t, " (float32, bfloat16, float16)");
  }
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Rows per task: enough work (~16k elements) to be worth waking a thread.
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

void check_rows(const at::Tensor& t, int64_t width, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width && t.stride(1) == 1, what,
              " must be [rows, ", width, "] with contiguous rows, got sizes ", t.sizes(),
              " strides ", t.strides());
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, rows of x and out may be strided.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  check_rows(x, h, "rms_norm x");
  check_rows(out, h, "rms_norm out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h && weight.scalar_type() == x.scalar_type()
              && out.scalar_type() == x.scalar_type(), "rms_norm: weight/out must match x");
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    const T* wp = ptr<T>(weight);
    T* op = ptr<T>(out);
    const int64_t xs = x.stride(0), os = out.stride(0);
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * xs;
        T* orow = op + r * os;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; ++i) {
          float v = to_f32(xr[i]);
          ss += v * v;
        }
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + feps);
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) orow[i] = from_f32<T>((to_f32(xr[i]) * inv) * to_f32(wp[i]));
      }
    });
  });
}

// new_residual = round(x + residual); out = rms_norm(new_residual). All [rows, h] contiguous.
void fused_add_rms_norm(at::Tensor& out, at::Tensor& new_residual, const at::Tensor& x,
                        const at::Tensor& residual, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), h = x.size(1);
  const at::Tensor* all[] = {&out, &new_residual, &x, &residual};
  for (const at::Tensor* t : all) {
    TORCH_CHECK(t->is_contiguous() && t->dim() == 2 && t->size(0) == rows && t->size(1) == h
                && t->scalar_type() == x.scalar_type(),
                "fused_add_rms_norm: out, new_residual, x, residual must be contiguous [", rows, ", ", h,
                "] of one dtype");
  }
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h && weight.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: weight must be [", h, "] of x's dtype");
  dispatch_float_types(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T *xp = ptr<T>(x), *rp = ptr<T>(residual), *wp = ptr<T>(weight);
    T *op = ptr<T>(out), *np = ptr<T>(new_residual);
    const float feps = static_cast<float>(eps);
    at::parallel_for(0, rows, row_grain(h), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t base = r * h;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < h; ++i) {
          const T sum = from_f32<T>(to_f32(xp[base + i]) + to_f32(rp[base + i]));
          np[base + i] = sum;
          float v = to_f32(sum);
          ss += v * v;
        }
        const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + feps);
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) op[base + i] = from_f32<T>((to_f32(np[base + i]) * inv) * to_f32(wp[i]));
      }
    });
  });
}

// x: [rows, 2d] (gate | up), out: [rows, d] = round(round(silu(gate)) * up).
void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.size(1) == 2 * d && out.size(0) == rows
              && out.size(1) == d && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: x [rows, 2d] and out [rows, d] must be contiguous, one dtype");
  dispatch_float_types(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    T* op = ptr<T>(out);
    at::parallel_for(0, rows, row_grain(2 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = xp + r * 2 * d;
        const T* u = g + d;
        T* o = op + r * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) {
          const T act = from_f32<T>(silu(to_f32(g[i])));
          o[i] = from_f32<T>(to_f32(act) * to_f32(u[i]));
        }
      }
    });
  });
}

// Rotates the first `rotary_dim` features of every head (neox: halves, not pairs) of a
// [tokens, heads, head_size] tensor with strided token/head dims into a contiguous `out`.
template <typename T>
void rotate_heads(T* out, const T* in, int64_t s_tok, int64_t s_head, int64_t tokens, int64_t heads,
                  int64_t head_size, const int64_t* pos, const float* cache, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / (heads * head_size)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* cos = cache + pos[t] * rotary_dim;
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = in + t * s_tok + h * s_head;
        T* o = out + (t * heads + h) * head_size;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_f32(x[i]), x2 = to_f32(x[i + half]);
          o[i] = from_f32<T>(x1 * cos[i] - x2 * sin[i]);
          o[i + half] = from_f32<T>(x2 * cos[i] + x1 * sin[i]);
        }
        for (int64_t i = rotary_dim; i < head_size; ++i) o[i] = x[i];
      }
    }
  });
}

void rotary_embedding(at::Tensor& q_out, at::Tensor& k_out, const at::Tensor& positions,
                      const at::Tensor& query, const at::Tensor& key, const at::Tensor& cos_sin_cache,
                      int64_t rotary_dim) {
  const int64_t tokens = query.size(0), d = query.size(2);
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key.size(0) == tokens && key.size(2) == d
              && query.stride(2) == 1 && key.stride(2) == 1,
              "rotary_embedding: query/key must be [tokens, heads, head_size] with contiguous heads");
  TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && q_out.sizes() == query.sizes()
              && k_out.sizes() == key.sizes() && key.scalar_type() == query.scalar_type()
              && q_out.scalar_type() == query.scalar_type() && k_out.scalar_type() == query.scalar_type(),
              "rotary_embedding: outputs must be contiguous and shaped/typed like query and key");
  TORCH_CHECK(cos_sin_cache.is_contiguous() && cos_sin_cache.scalar_type() == at::kFloat
              && cos_sin_cache.size(1) == rotary_dim && rotary_dim % 2 == 0 && rotary_dim <= d,
              "rotary_embedding: cos_sin_cache must be contiguous float32 [max_position, rotary_dim]");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong && positions.numel() == tokens,
              "rotary_embedding: positions must be contiguous int64 [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                " is outside the rotary table [0, ", max_pos, ")");
  }
  const float* cache = cos_sin_cache.data_ptr<float>();
  dispatch_float_types(query.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    rotate_heads(ptr<T>(q_out), ptr<T>(query), query.stride(0), query.stride(1), tokens, query.size(1), d, pos,
                 cache, rotary_dim);
    rotate_heads(ptr<T>(k_out), ptr<T>(key), key.stride(0), key.stride(1), tokens, key.size(1), d, pos, cache,
                 rotary_dim);
  });
}

}  // namespace core_cpu
