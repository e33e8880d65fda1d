// Standalone check of csrc/cpu/quant_gemm.cpp on every ISA path the running CPU has, without
// torch: built natively, and cross-built for AArch64 and run under qemu-user by
// tests/unit/test_cpu_isa.py. For random weights and activations of several shapes it
// compares each path's output with a double-precision reference written here: the weights
// dequantized from their codes, and (int8 mode) the activations from codes this file computes
// with its own rounding. Prints one line per path and exits non-zero on any mismatch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "quant_gemm.h"

using namespace core_cpu;

namespace {

struct Case {
  int bits;
  int64_t m, n, k;
};

struct Packed {
  std::vector<uint8_t> codes;
  std::vector<float> scales, mins;
  std::vector<double> dense;  // [n, k] the values the codes stand for
};

Packed random_weights(std::mt19937& rng, int bits, int64_t n, int64_t k) {
  Packed p;
  const int64_t groups = k / 32;
  std::uniform_real_distribution<float> scale(0.001f, 0.05f), shift(-0.2f, 0.2f);
  std::uniform_int_distribution<int> c4(0, 15), c8(-127, 127);
  p.codes.assign(bits == 4 ? n * k / 2 : n * k, 0);
  p.scales.resize(n * groups);
  p.mins.resize(n * groups);
  p.dense.resize(n * k);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float sc = scale(rng), mn = bits == 4 ? shift(rng) : 0.f;
      p.scales[r * groups + g] = sc;
      p.mins[r * groups + g] = mn;
      for (int j = 0; j < 32; ++j) {
        const int code = bits == 4 ? c4(rng) : c8(rng);
        p.dense[r * k + g * 32 + j] = static_cast<double>(code) * sc + mn;
        if (bits == 4) {
          uint8_t& byte = p.codes[r * (k / 2) + g * 16 + (j & 15)];
          byte = static_cast<uint8_t>(j < 16 ? (byte & 0xF0) | code : (byte & 0x0F) | (code << 4));
        } else {
          p.codes[r * k + g * 32 + j] = static_cast<uint8_t>(static_cast<int8_t>(code));
        }
      }
    }
  }
  return p;
}

// The activations the int8 mode multiplies: scale max|x| / 127, round half to even.
std::vector<double> act_values(const std::vector<float>& x, int64_t m, int64_t k) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t g = 0; g < k / 32; ++g) {
      const float* src = &x[r * k + g * 32];
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::fmax(amax, std::fabs(src[j]));
      const float d = amax / 127.f, inv = amax > 0.f ? 1.f / d : 0.f;
      for (int j = 0; j < 32; ++j) out[r * k + g * 32 + j] = std::nearbyint(src[j] * inv) * static_cast<double>(d);
    }
  }
  return out;
}

// Largest |got - want| relative to the largest |want| of the case.
double run_case(Isa isa, ActMode mode, const Case& c, std::mt19937& rng, Int8Kernel kernel = Int8Kernel::kAuto) {
  const Packed p = random_weights(rng, c.bits, c.n, c.k);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(c.m * c.k);
  for (float& v : x) v = normal(rng);
  const QuantWeights w{c.bits, p.codes.data(), p.scales.data(), p.mins.data(), c.n, c.k};
  std::vector<float> out(c.m * c.n, NAN);
  std::vector<double> xs(x.begin(), x.end());
  if (mode == ActMode::kInt8) {
    std::vector<int8_t> q(c.m * c.k);
    std::vector<float> d(c.m * c.k / 32), s(c.m * c.k / 32);
    quantize_rows(isa, x.data(), c.k, c.k, 0, c.m, q.data(), d.data(), s.data());
    xs = act_values(x, c.m, c.k);
    for (size_t i = 0; i < q.size(); ++i) {  // the path's codes must be this file's codes
      if (std::fabs(q[i] * static_cast<double>(d[i / 32]) - xs[i]) > 1e-12) return INFINITY;
    }
    const QuantActs a{q.data(), d.data(), s.data()};
    // Two column ranges and two row ranges, as the torch op splits work across threads.
    const int64_t mh = c.m / 2, nh = c.n / 2;
    quant_gemm_int8(isa, out.data(), c.n, a, 0, mh, w, 0, c.n, kernel);
    quant_gemm_int8(isa, out.data(), c.n, a, mh, c.m, w, 0, nh, kernel);
    quant_gemm_int8(isa, out.data(), c.n, a, mh, c.m, w, nh, c.n, kernel);
  } else {
    quant_gemm_f32(isa, out.data(), c.n, x.data(), c.k, 0, c.m, w, 0, c.n);
  }
  double worst = 0.0, top = 1e-30;
  for (int64_t r = 0; r < c.m; ++r) {
    for (int64_t col = 0; col < c.n; ++col) {
      double want = 0.0;
      for (int64_t i = 0; i < c.k; ++i) want += xs[r * c.k + i] * p.dense[col * c.k + i];
      top = std::fmax(top, std::fabs(want));
      const double err = std::fabs(out[r * c.n + col] - want);
      worst = std::isnan(err) ? INFINITY : std::fmax(worst, err);
    }
  }
  return worst / top;
}

}  // namespace

int main() {
  // Row counts around the panel kernel's 4-row blocks (and its 4 / 5-row switch-over), column
  // counts around its 8-column panels (remainders 1..7), as the ranges below split them too.
  const Case cases[] = {{4, 1, 64, 576}, {4, 5, 37, 96}, {4, 17, 16, 1536}, {4, 4, 8, 32},
                        {4, 8, 15, 64}, {4, 11, 26, 128}, {4, 46, 73, 576}, {4, 3, 9, 32},
                        {8, 1, 64, 576}, {8, 6, 13, 192}, {8, 9, 40, 64}, {8, 10, 23, 96},
                        {8, 22, 67, 576}, {8, 14, 3, 32}};
  std::mt19937 rng(1234);
  bool ok = true;
  for (Isa isa : runnable_isas()) {
    for (ActMode mode : {ActMode::kF32, ActMode::kInt8}) {
      double worst = 0.0;
      for (const Case& c : cases) worst = std::fmax(worst, run_case(isa, mode, c, rng));
      const bool pass = worst < 2e-5;
      ok = ok && pass;
      std::printf("%s %s %s: max relative error %.2e\n", pass ? "PASS" : "FAIL", isa_name(isa),
                  mode == ActMode::kF32 ? "f32" : "int8", worst);
    }
    // Each int8 kernel forced on every case (x86 has two; other paths ignore the choice).
    for (Int8Kernel kernel : {Int8Kernel::kTiles, Int8Kernel::kPanels}) {
      double worst = 0.0;
      for (const Case& c : cases) worst = std::fmax(worst, run_case(isa, ActMode::kInt8, c, rng, kernel));
      const bool pass = worst < 2e-5;
      ok = ok && pass;
      std::printf("%s %s int8 %s: max relative error %.2e\n", pass ? "PASS" : "FAIL", isa_name(isa),
                  kernel == Int8Kernel::kTiles ? "tiles" : "panels", worst);
    }
  }
  return ok ? 0 : 1;
}
