// Weight-only quantized linear kernels (see quant_gemm.h for the layouts).
//
// quant_gemv: a decode step multiplies a few activation rows by every weight once, so it is
// bound by reading the weights. One warp owns one output row: its lanes stream the row's
// codes as consecutive 16-byte vectors (coalesced), decode each vector to floats in
// registers, dequantizes it (one FMA per weight) and multiplies it into every activation row
// (small, L1/L2 resident): the weights are read once whatever the number of rows. fp8 codes
// with 16-bit activations take the tensor-core kernel below instead (fp8_gemv_mma_kernel) at
// 3-16 rows, and at one row on small weights (fp8_mma_applies); int4 codes with 16-bit
// activations and integer zero points likewise at 2-16 rows, and at one row on weights of
// more than 2^24 codes (int4_gemv_mma_kernel, int4_mma_applies).
//
// quant_dequant: W in the activation dtype, for prefill steps, which then run one dense GEMM
// (compute-bound there, so the extra pass over W is small next to it).
#include <type_traits>

#include "../cuda_compat.h"
#include "../dtype_traits.cuh"
#include "../paired_epilogue.cuh"
#include "quant_gemm.h"

namespace core_kernels {
namespace {

constexpr int kGemvWarps = 8;  // output rows per CTA
constexpr int kDequantThreads = 256;

#if !CORE_HAS_FP8_KV
// A float8 e4m3 ("fn") byte as a float, where the toolkit has no conversion (HIP). Its 7
// magnitude bits shifted to bits 20-26 of a float32 read as 2^(e - 127) * 1.m (e > 0) or
// 0.m * 2^-126 (e == 0); multiplying by 2^120 moves the exponent bias from 127 to e4m3's 7.
// Exact for every finite e4m3 value.
__device__ __forceinline__ float fp8_e4m3_to_float(uint32_t byte) {
  const float magnitude = __uint_as_float((byte & 0x7fu) << 20) * 1.329227995784916e36f;  // 2^120
  return (byte & 0x80u) ? -magnitude : magnitude;
}
#endif

// Decoding one 16-byte vector of codes into kPer floats (in input order).
template <QuantCode C>
struct Codes;

template <>
struct Codes<QuantCode::kInt4> {
  static constexpr int kPer = 32;
  static constexpr int kRowBytesDiv = 2;  // bytes per row = k / 2
  __device__ __forceinline__ static void decode(const uint4& v, float (&q)[kPer]) {
    uint32_t w[4];
    unpack_words(v, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 8; ++j) q[8 * i + j] = static_cast<float>((w[i] >> (4 * j)) & 15u);
    }
  }
};

template <>
struct Codes<QuantCode::kInt8> {
  static constexpr int kPer = 16;
  static constexpr int kRowBytesDiv = 1;
  __device__ __forceinline__ static void decode(const uint4& v, float (&q)[kPer]) {
    uint32_t w[4];
    unpack_words(v, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        q[4 * i + j] = static_cast<float>(static_cast<int8_t>((w[i] >> (8 * j)) & 0xffu));
      }
    }
  }
};

template <>
struct Codes<QuantCode::kFp8> {
  static constexpr int kPer = 16;
  static constexpr int kRowBytesDiv = 1;
  __device__ __forceinline__ static void decode(const uint4& v, float (&q)[kPer]) {
    uint32_t w[4];
    unpack_words(v, w);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#if CORE_HAS_FP8_KV  // the toolkit's pair conversion: one cvt per two codes on sm_89+
      const float2 lo = fp8x2_e4m3_bits_to_float2(static_cast<uint16_t>(w[i] & 0xffffu));
      const float2 hi = fp8x2_e4m3_bits_to_float2(static_cast<uint16_t>(w[i] >> 16));
      q[4 * i] = lo.x, q[4 * i + 1] = lo.y, q[4 * i + 2] = hi.x, q[4 * i + 3] = hi.y;
#else
#pragma unroll
      for (int j = 0; j < 4; ++j) q[4 * i + j] = fp8_e4m3_to_float((w[i] >> (8 * j)) & 0xffu);
#endif
    }
  }
};

// M: the row bucket (1, 2, 4, 8 or 16); rows a.m .. M-1 are computed from row 0 (always
// valid, no branch inside the unrolled loops) and never written. Per 16-byte code vector the
// weights are dequantized once, V at a time (w = q * scale + min), and each is used by all M
// rows; only V weights, V activations and M sums are live at once. Unlike quant_dequant, the
// dequantization here may fuse into one FMA: the sums run in another order than any
// reference's anyway (lanes, then a shuffle tree), so the GEMV's contract is a tolerance
// (tests/cuda/test_cuda_quant.py::check), and at M = 1 the int4 path is close to the ALU
// limit, where an extra rounding step per weight would cost.
//
// Each lane loads GemvUnroll<C, M> of its code vectors (through the read-only path) before it
// decodes any, so a warp keeps 32 x 16 x that many bytes in
// flight instead of one vector per lane per trip: one at a time, the 2026-12-02 H200 run read
// fp8 codes at 1.46 TB/s and int4 at 1.1-1.2 TB/s at M = 1, latency-bound. From 8 rows the
// kernel is bound by its arithmetic (every weight meets M rows) and the extra registers would
// spill, so the unroll shrinks with M. int4 keeps one vector per trip: 32 weights per vector
// make it ALU-bound already, and the same H200 run measured it 10-25 % slower unrolled.
template <QuantCode C, int M>
struct GemvUnroll {
  static constexpr int kValue = C == QuantCode::kInt4 ? 1 : (M <= 2 ? 4 : (M <= 4 ? 2 : 1));
};

// Which scale group a code vector lies in (every vector lies inside one: group % kPer == 0):
// v / d for d = group / kPer vectors per group, as one multiply-high by mul = ceil(2^32 / d)
// (d >= 2; exact while v * d < 2^32, i.e. for rows of fewer than 2^16 vectors at any d, and
// checked by group_of), v itself for d = 1, 0 when the whole row is one group: at 1-2 rows
// an integer division per 16 weights (~20 instructions) showed in the H100 timings. From 4
// rows the kernel keeps the division: there the lookup changed the register allocation
// (int4 at 4 rows: 64 -> 75 registers, 4 -> 3 CTAs per SM) for no measured gain.
struct GroupOf {
  uint32_t mul;
  int add;
  __device__ __forceinline__ int operator()(int v) const {
    return static_cast<int>(__umulhi(static_cast<uint32_t>(v), mul)) + v * add;
  }
};

// The lookup for a row of `units` pieces of `per` inputs (a code vector, a tensor-core
// half-trip), each inside one group; false where the multiply-high would not be exact (rows
// of 2^16 vectors or more, i.e. k >= 2^20 fp8 inputs, with more than one group).
bool group_of(const QuantGemvArgs& a, int per, GroupOf& out) {
  const int64_t d = a.group / per, units = a.k / per;
  if (a.group == a.k) {
    out = {0u, 0};
  } else if (d == 1) {
    out = {0u, 1};
  } else {
    if (units * d >= (int64_t(1) << 32)) return false;
    out = {static_cast<uint32_t>(((int64_t(1) << 32) + d - 1) / d), 0};
  }
  return true;
}

// Activation row m's V inputs from k0 + j as floats (rows past a.m read row 0: always valid,
// and their sums are never written).
template <typename T>
__device__ __forceinline__ void activations(const QuantGemvArgs& a, const typename T::Storage* x, int m, int k0,
                                            int j, float (&xf)[T::kVec]) {
  T::to_float(*reinterpret_cast<const uint4*>(x + (m < a.m ? m : 0) * a.x_stride + k0 + j), xf);
}

template <typename T, QuantCode C, int M, bool kMins>
__device__ __forceinline__ void gemv_vector(const QuantGemvArgs& a, const uint4& cv, int v, GroupOf vec_group,
                                            const float* scales, const float* mins,
                                            const typename T::Storage* x, float (&acc)[M]) {
  using Code = Codes<C>;
  constexpr int P = Code::kPer;
  constexpr int V = T::kVec;
  float q[P];
  Code::decode(cv, q);
  const int k0 = v * P;
  const int g = M <= 2 ? vec_group(v) : k0 / a.group;
  const float s = scales[g];
  if constexpr (!kMins && M <= 2) {
    // w = q * s: the vector's codes meet the activations first and the scale once per
    // vector and row (one FMA per weight instead of two). Only at 1-2 rows: from 4 the
    // dequantization below is shared by enough rows, and the H100 measured this form up to
    // 32 % slower there (2026-12-06, docs/quantization.md).
    float part[M];
#pragma unroll
    for (int m = 0; m < M; ++m) part[m] = 0.f;
#pragma unroll
    for (int j = 0; j < P / V; ++j) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[V];
        activations<T>(a, x, m, k0, j * V, xf);
#pragma unroll
        for (int i = 0; i < V; ++i) part[m] = fmaf(q[j * V + i], xf[i], part[m]);
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = fmaf(part[m], s, acc[m]);
    return;
  }
  const float mn = (kMins || mins != nullptr) ? mins[g] : 0.f;
#pragma unroll
  for (int j = 0; j < P / V; ++j) {
    float w[V];
#pragma unroll
    for (int i = 0; i < V; ++i) w[i] = q[j * V + i] * s + mn;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[V];
      activations<T>(a, x, m, k0, j * V, xf);
#pragma unroll
      for (int i = 0; i < V; ++i) acc[m] += w[i] * xf[i];
    }
  }
}

// A paired epilogue's CTA (kEpi != kPlain, one activation row): warps w and w + kGemvPairs
// sum the two rows of output pair blockIdx.x * kGemvPairs + w (paired_epilogue.cuh), each as
// the plain kernel sums a row, and after a barrier warp 0 combines each pair's two sums.
constexpr int kGemvPairs = kGemvWarps / 2;

template <int kEpi>
__device__ __forceinline__ RowPair quant_pair(const QuantGemvArgs& a, int p) {
  return kEpi == kSiluMul ? silu_pair(p, a.n / 2) : rope_pair(p, a.rope);
}

template <typename T, QuantCode C, int M, bool kMins, int kEpi = kPlain>
__device__ __forceinline__ void quant_gemv_body(const QuantGemvArgs& a, const GroupOf& vec_group,
                                                int prefetch_lines) {
  using Code = Codes<C>;
  constexpr int P = Code::kPer;
  constexpr bool kPaired = kEpi != kPlain;
  static_assert(!kPaired || M == 1, "the paired epilogues take one activation row");
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  int row;
  bool active = true;  // paired: a pair past the last sums nothing but meets the barrier
  if constexpr (kPaired) {
    const int p = blockIdx.x * kGemvPairs + warp % kGemvPairs;
    active = p < a.n / 2;
    const RowPair rp = active ? quant_pair<kEpi>(a, p) : RowPair{0, 0, -1};
    row = warp < kGemvPairs ? rp.row0 : rp.row1;
  } else {
    row = blockIdx.x * kGemvWarps + warp;
    if (row >= a.n) return;  // the whole warp leaves; nothing below synchronises the CTA
  }
  const int vecs = active ? a.k / P : 0;
  const int groups = a.k / a.group;
  const auto* codes = reinterpret_cast<const uint4*>(a.codes + int64_t(row) * (a.k / Code::kRowBytesDiv));
  const float* scales = a.scales + int64_t(row) * groups;
  const float* mins = a.mins != nullptr ? a.mins + int64_t(row) * groups : nullptr;
  const auto* x = static_cast<const typename T::Storage*>(a.x);
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  constexpr int U = GemvUnroll<C, M>::kValue;
  int v = lane;
  // Launched with launch_dependent: the CTAs are resident while the kernel that produces x
  // finishes. The codes do not depend on it: at one row their starts go to L2 first
  // (cuda_compat.h); quant_gemv_1row_kernel's launch bounds keep that at 32 registers (8 CTAs
  // per SM), where the prefetch's address would otherwise take 38-40 (no spills; ptxas -v).
  // (From 2 rows the instances' registers grew with it, up to 100 -> 144: no prefetch there.)
  if constexpr (M == 1) {
    if (active) prefetch_row_start(codes, prefetch_lines, lane);
  }
  grid_dependency_wait();
  for (; v + (U - 1) * kWarpSize < vecs; v += U * kWarpSize) {
    uint4 cv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) cv[u] = __ldg(codes + v + u * kWarpSize);
#pragma unroll
    for (int u = 0; u < U; ++u) gemv_vector<T, C, M, kMins>(a, cv[u], v + u * kWarpSize, vec_group, scales, mins, x, acc);
  }
  for (; v < vecs; v += kWarpSize) gemv_vector<T, C, M, kMins>(a, __ldg(codes + v), v, vec_group, scales, mins, x, acc);
  allow_dependent_launch();  // every code is read: the next kernel may be scheduled
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int off = kWarpSize / 2; off > 0; off /= 2) acc[m] += warp_shfl_xor(acc[m], off);
  }
  if constexpr (kPaired) {
    __shared__ float sums[kGemvWarps];
    if (lane == 0) sums[threadIdx.x / kWarpSize] = acc[0];  // re-read: one register fewer in the loop
    __syncthreads();
    const int p = blockIdx.x * kGemvPairs + lane;
    if (threadIdx.x >= kGemvPairs || p >= a.n / 2) return;  // warp 0's first kGemvPairs lanes
    auto* out = static_cast<typename T::Storage*>(a.out);
    if constexpr (kEpi == kSiluMul) {
      out[p] = silu_mul<T>(sums[lane], sums[lane + kGemvPairs]);
    } else {
      store_rope_pair<T>(out, quant_pair<kEpi>(a, p), sums[lane], sums[lane + kGemvPairs], a.rope, 0);
    }
    return;
  }
  if (lane == 0) {
    auto* out = static_cast<typename T::Storage*>(a.out);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m < a.m) out[int64_t(m) * a.n + row] = T::from_float(acc[m]);
    }
  }
}

template <typename T, QuantCode C, int M, bool kMins>
__global__ void __launch_bounds__(kGemvWarps * kWarpSize)
    quant_gemv_kernel(const QuantGemvArgs a, const GroupOf vec_group) {
  quant_gemv_body<T, C, M, kMins>(a, vec_group, 0);
}

// One row of 16-bit activations: at most 32 registers, 8 CTAs (64 warps) per SM; with mins
// (int4 with an offset per group) 40 registers, 6 CTAs, as before the prefetch (32 spills).
// kEpi: a paired epilogue (SiLU-and-mul, rotary embedding) or none. With one, int8 codes
// (four code vectors in flight) spilled 8 bytes at 32 registers, so they take 40 as with mins
// (6 CTAs per SM; registers come in steps of 8).
template <typename T, QuantCode C, bool kMins, int kEpi>
__global__ void __launch_bounds__(kGemvWarps * kWarpSize, kMins || (kEpi != kPlain && C == QuantCode::kInt8) ? 6 : 8)
    quant_gemv_1row_kernel(const QuantGemvArgs a, const GroupOf vec_group, const int prefetch_lines) {
  quant_gemv_body<T, C, 1, kMins, kEpi>(a, vec_group, prefetch_lines);
}

template <typename T>
__device__ __forceinline__ void store_floats(typename T::Storage* dst, const float* f) {
  typename T::Storage s[T::kVec];
#pragma unroll
  for (int i = 0; i < T::kVec; ++i) s[i] = T::from_float(f[i]);
  uint4 v;
  __builtin_memcpy(&v, s, sizeof(v));
  *reinterpret_cast<uint4*>(dst) = v;
}

template <typename T, QuantCode C>
__global__ void quant_dequant_kernel(const QuantDequantArgs a) {
  using Code = Codes<C>;
  constexpr int P = Code::kPer;
  const int vecs = a.k / P;
  const int groups = a.k / a.group;
  const int64_t total = int64_t(a.n) * vecs;
  auto* out = static_cast<typename T::Storage*>(a.out);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / vecs;
    const int v = static_cast<int>(i % vecs);
    const auto* codes = reinterpret_cast<const uint4*>(a.codes + row * (a.k / Code::kRowBytesDiv));
    float q[P];
    Code::decode(codes[v], q);
    const int k0 = v * P;
    const int g = k0 / a.group;
    const float s = a.scales[row * groups + g];
    // Bit-exact against the reference dequantization (core.quantization.tensors: the fp32
    // product, rounded, then the min added, rounded): __fmul_rn/__fadd_rn keep nvcc from
    // contracting the two into one FMA, whose single rounding differs in the last bit
    // (the 24 int4-with-mins failures of the 2026-12-02 H200 run).
    if (a.mins != nullptr) {
      const float mn = a.mins[row * groups + g];
#pragma unroll
      for (int j = 0; j < P; ++j) q[j] = __fadd_rn(__fmul_rn(q[j], s), mn);
    } else {
#pragma unroll
      for (int j = 0; j < P; ++j) q[j] = __fmul_rn(q[j], s);
    }
#pragma unroll
    for (int j = 0; j < P / T::kVec; ++j) store_floats<T>(out + row * a.k + k0 + j * T::kVec, q + j * T::kVec);
  }
}

// Every GEMV launch is a launch_dependent (cuda_compat.h): each kernel's CTAs are resident
// while the kernel before it (the norm, SiLU-and-mul, the attention's reduce) finishes, and
// wait for it before reading x (the tensor-core kernels request their first codes before
// that wait; this one waits first, see quant_gemv_kernel).
template <typename T, QuantCode C, int M, bool kMins>
cudaError_t launch_gemv_rows(const QuantGemvArgs& a, const GroupOf groups, cudaStream_t stream) {
  const dim3 grid((a.n + kGemvWarps - 1) / kGemvWarps), block(kGemvWarps * kWarpSize);
  if constexpr (M == 1 && sizeof(typename T::Storage) == 2) {
    const int lines = prefetch_lines_per_row(a.n, int64_t(a.k) / Codes<C>::kRowBytesDiv);
    return launch_dependent(quant_gemv_1row_kernel<T, C, kMins, kPlain>, grid, block, 0, stream, a, groups, lines);
  } else {
    return launch_dependent(quant_gemv_kernel<T, C, M, kMins>, grid, block, 0, stream, a, groups);
  }
}

// One row with a paired epilogue: n / 2 pairs, kGemvPairs a CTA (fp16 / bf16 activations).
template <typename T, QuantCode C, bool kMins, int kEpi>
cudaError_t launch_gemv_paired(const QuantGemvArgs& a, const GroupOf groups, cudaStream_t stream) {
  const dim3 grid((a.n / 2 + kGemvPairs - 1) / kGemvPairs), block(kGemvWarps * kWarpSize);
  const int lines = prefetch_lines_per_row(a.n, int64_t(a.k) / Codes<C>::kRowBytesDiv);
  return launch_dependent(quant_gemv_1row_kernel<T, C, kMins, kEpi>, grid, block, 0, stream, a, groups, lines);
}

template <typename T, QuantCode C, bool kMins>
cudaError_t launch_gemv_epilogue(const QuantGemvArgs& a, const GroupOf groups, cudaStream_t stream) {
  if (a.m != 1 || a.n % 2 != 0 || (a.silu_and_mul && a.rope.heads > 0) ||
      (!a.silu_and_mul && !rope_spec_fits(a.rope, a.n))) {
    return cudaErrorInvalidValue;
  }
  if constexpr (sizeof(typename T::Storage) == 2) {
    return a.silu_and_mul ? launch_gemv_paired<T, C, kMins, kSiluMul>(a, groups, stream)
                          : launch_gemv_paired<T, C, kMins, kRope>(a, groups, stream);
  }
  return cudaErrorInvalidValue;  // fp32 activations: no paired epilogue
}

// At 1-2 rows, with and without mins (int4 only) are two instances: a runtime branch between
// the two bodies kept both live and cost the no-mins one 16 registers (40 -> 56 at M = 1:
// 6 -> 4 CTAs per SM). From 4 rows both take the one body, mins checked at run time.
template <typename T, QuantCode C>
cudaError_t launch_gemv(const QuantGemvArgs& a, cudaStream_t stream) {
  GroupOf groups;
  if (!group_of(a, Codes<C>::kPer, groups) || (a.mins != nullptr && C != QuantCode::kInt4)) {
    return cudaErrorInvalidValue;
  }
  if (a.silu_and_mul || a.rope.heads > 0) {
    if (a.mins == nullptr) return launch_gemv_epilogue<T, C, false>(a, groups, stream);
    if constexpr (C == QuantCode::kInt4) return launch_gemv_epilogue<T, C, true>(a, groups, stream);
    return cudaErrorInvalidValue;  // refused above
  }
  if (a.m <= 2 && a.mins != nullptr) {
    if constexpr (C == QuantCode::kInt4) {
      return a.m <= 1 ? launch_gemv_rows<T, C, 1, true>(a, groups, stream)
                      : launch_gemv_rows<T, C, 2, true>(a, groups, stream);
    }
    return cudaErrorInvalidValue;  // refused above
  }
  if (a.m <= 1) return launch_gemv_rows<T, C, 1, false>(a, groups, stream);
  if (a.m <= 2) return launch_gemv_rows<T, C, 2, false>(a, groups, stream);
  if (a.m <= 4) return launch_gemv_rows<T, C, 4, false>(a, groups, stream);
  if (a.m <= 8) return launch_gemv_rows<T, C, 8, false>(a, groups, stream);
  return launch_gemv_rows<T, C, 16, false>(a, groups, stream);
}

#ifndef USE_ROCM
// ---- decode GEMVs on tensor cores (NVIDIA sm_80+): what the fp8 and int4 kernels share ------
// A warp owns 16 output rows (one m16n8k16 tile) and n-tiles of 8 activation rows; a CTA of
// `split` warps splits K over the same 16 rows.
constexpr int kMmaRowsPerWarp = 16;
constexpr int kMmaMaxSplit = 8;

// Warps per CTA: split K while the grid stays within max_warps (fp8 2,048, about 15 per SM of
// an H200; int4 8,192) and every warp keeps >= 4 trips of its loop.
inline int choose_mma_split(int tiles, int trips, int max_warps) {
  int split = 1;
  while (split < kMmaMaxSplit && int64_t(tiles) * split * 2 <= max_warps && trips / (split * 2) >= 4) split *= 2;
  return split;
}

// The tile's sums, acc[nt]: rows g (e 0-1) and g + 8 (e 2-3) of the tile starting at row0,
// activation rows 8 nt + 2 t + (e & 1) (g = lane / 4, t = lane % 4). Warp 0 adds the other
// warps' sums in a fixed order (deterministic) and writes the rows that exist.
template <typename T, int NT>
__device__ __forceinline__ void mma_tile_store(const QuantGemvArgs& a, float (&acc)[NT][4], int row0) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int split = blockDim.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  if (split > 1) {
    __shared__ float red[kMmaMaxSplit][NT * 4][kWarpSize];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp][nt * 4 + e][lane] = acc[nt][e];
    }
    __syncthreads();
    if (warp != 0) return;
    for (int w = 1; w < split; ++w) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += red[w][nt * 4 + e][lane];
      }
    }
  }
  auto* out = static_cast<typename T::Storage*>(a.out);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = 8 * nt + 2 * t + (e & 1);
      const int row = row0 + g + (e >= 2 ? 8 : 0);
      if (m < a.m && row < a.n) out[int64_t(m) * a.n + row] = T::from_float(acc[nt][e]);
    }
  }
}
#endif  // USE_ROCM

#if CORE_HAS_FP8_KV
// ---- fp8 weights on tensor cores (decode rows, fp16/bf16 activations) ---------------------
// The CUDA-core kernel above widens every fp8 code to a float and spends ~7.7 thread
// instructions per weight (ncu, 2026-12-02): at M = 1 it read codes at ~2 TB/s, issue- and
// latency-bound. Here a warp owns 16 output rows and multiplies them with mma.sync m16n8k16
// (fp16 inputs, fp32 sums): a weight costs half a pair conversion (e4m3x2 -> f16x2, exact)
// and 1/256 of an mma, so the loads decide the speed.
//
// Layout of one trip (128 inputs, k0 = 128 c): lane (g = lane / 4, t = lane % 4) loads the 32
// codes k0 + 32 t .. +32 of output rows g and g + 8 (two 16-byte vectors each: 128 contiguous
// bytes per row across the quad). A dot product may visit its inputs in any order as long as
// A and B agree, so mma step j (0-7) gives this lane's k-slots (2t, 2t+1 | 2t+8, 2t+9) the
// inputs k0 + 32 t + 4 j + (0, 1 | 2, 3): A's words are the code pairs as loaded and B's the
// activation pairs at the same positions, read by the lanes of activation row g (n-tile 0)
// and g + 8 (n-tile 1); rows past m are zeros.
//
// bf16 activations enter as fp16 times a power of two, 2^s, chosen per trip and activation
// row by the 4 lanes that read it (their largest |x| lands in [2^14, 2^15)): every bf16
// value at least 2^-28 times the trip's largest converts exactly (bf16 has 8 significant
// bits, fp16 11, and fp16's normal range reaches down to 2^-14); smaller ones round to fp16
// subnormals, below fp32's rounding of the sum. The trip's sums are multiplied back by
// 2^-s with the group's weight scale (group % 128 == 0) and added in fp32.
//
// Small layers (the output projection, the down projection: 256 tiles of 16 rows) give too
// few warps to keep HBM busy, so a CTA of S warps splits K over the same 16 rows (S from
// choose_mma_split) and adds its partial sums through shared memory.
constexpr int kMmaTrip = 128;  // inputs per trip and warp

template <typename T>
struct MmaActivations;

// load: the 32 activations k0 + 32 t .. +32 of one row as 16 fp16 pairs; returns the
// exponent s of the row's trip-wide power of two 2^s (0 for fp16: taken as they are).
template <>
struct MmaActivations<Fp16> {
  __device__ __forceinline__ static int load(const uint16_t* row, uint32_t (&w)[16]) {
    const uint4* v = reinterpret_cast<const uint4*>(row);
#pragma unroll
    for (int i = 0; i < 4; ++i) unpack_words(__ldg(v + i), *reinterpret_cast<uint32_t(*)[4]>(w + 4 * i));
    return 0;
  }
};

template <>
struct MmaActivations<Bf16> {
  __device__ __forceinline__ static int load(const uint16_t* row, uint32_t (&w)[16]) {
    const uint4* v = reinterpret_cast<const uint4*>(row);
    float f[32];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      Bf16::to_float(__ldg(v + i), *reinterpret_cast<float(*)[Bf16::kVec]>(f + 8 * i));
#pragma unroll
      for (int j = 0; j < 8; j += 2) amax = fmaxf(amax, fmaxf(fabsf(f[8 * i + j]), fabsf(f[8 * i + j + 1])));
    }
    // The quad's lanes hold the row's 128 inputs of this trip.
    amax = fmaxf(amax, warp_shfl_xor(amax, 1));
    amax = fmaxf(amax, warp_shfl_xor(amax, 2));
    // amax in [2^e, 2^(e+1)) -> s = 14 - e; clamped so that 2^s and 2^-s are normal floats
    // (all zeros: any s; inf / NaN stay what they are).
    const int e = static_cast<int>((__float_as_uint(amax) >> 23) & 0xffu) - 127;
    const int s = max(-126, min(126, 14 - e));
    const float up = __uint_as_float(static_cast<uint32_t>(s + 127) << 23);
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = float2_to_half2_bits(f[2 * i] * up, f[2 * i + 1] * up);
    return s;
  }
};

// 2^-s as a float (s from MmaActivations::load, within [-126, 126]).
__device__ __forceinline__ float pow2_neg(int s) { return __uint_as_float(static_cast<uint32_t>(127 - s) << 23); }

// NT: n-tiles of 8 activation rows (1 for m <= 8, 2 for m <= 16).
template <typename T, int NT>
__global__ void __launch_bounds__(kMmaMaxSplit * kWarpSize)
    fp8_gemv_mma_kernel(const QuantGemvArgs a) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int split = blockDim.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * kMmaRowsPerWarp;
  // Rows past n (the last tile) recompute row n - 1 and are never written.
  const int r_lo = min(row0 + g, a.n - 1), r_hi = min(row0 + g + 8, a.n - 1);
  const uint8_t* w_lo = a.codes + int64_t(r_lo) * a.k + 32 * t;
  const uint8_t* w_hi = a.codes + int64_t(r_hi) * a.k + 32 * t;
  const int groups = a.k / a.group;
  const float* s_lo = a.scales + int64_t(r_lo) * groups;
  const float* s_hi = a.scales + int64_t(r_hi) * groups;
  const auto* x = static_cast<const uint16_t*>(a.x);
  bool has_x[NT];
  const uint16_t* x_row[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = g + 8 * nt;
    has_x[nt] = m < a.m;
    x_row[nt] = x + int64_t(has_x[nt] ? m : 0) * a.x_stride + 32 * t;
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  const int trips = a.k / kMmaTrip;
  int c = warp;
  uint4 cur[4] = {};
  if (c < trips) {
    const int k0 = c * kMmaTrip;
    cur[0] = __ldg(reinterpret_cast<const uint4*>(w_lo + k0));
    cur[1] = __ldg(reinterpret_cast<const uint4*>(w_lo + k0 + 16));
    cur[2] = __ldg(reinterpret_cast<const uint4*>(w_hi + k0));
    cur[3] = __ldg(reinterpret_cast<const uint4*>(w_hi + k0 + 16));
  }
  grid_dependency_wait();  // the first trip's codes are in flight; x comes from the previous kernel
  for (; c < trips; c += split) {
    const int k0 = c * kMmaTrip;
    // The next trip's codes are in flight while this one multiplies.
    uint4 next[4] = {};
    if (c + split < trips) {
      const int k1 = k0 + split * kMmaTrip;
      next[0] = __ldg(reinterpret_cast<const uint4*>(w_lo + k1));
      next[1] = __ldg(reinterpret_cast<const uint4*>(w_lo + k1 + 16));
      next[2] = __ldg(reinterpret_cast<const uint4*>(w_hi + k1));
      next[3] = __ldg(reinterpret_cast<const uint4*>(w_hi + k1 + 16));
    }
    // Every lane loads (lanes past m read row 0 and zero it): load's quad shuffles need the
    // whole warp converged.
    uint32_t xw[NT][16];
    int shift[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      shift[nt] = MmaActivations<T>::load(x_row[nt] + k0, xw[nt]);
#pragma unroll
      for (int i = 0; i < 16; ++i) xw[nt][i] = has_x[nt] ? xw[nt][i] : 0u;
    }
    const uint32_t lo[8] = {cur[0].x, cur[0].y, cur[0].z, cur[0].w, cur[1].x, cur[1].y, cur[1].z, cur[1].w};
    const uint32_t hi[8] = {cur[2].x, cur[2].y, cur[2].z, cur[2].w, cur[3].x, cur[3].y, cur[3].z, cur[3].w};
    float part[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) part[nt][0] = part[nt][1] = part[nt][2] = part[nt][3] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t af[4] = {fp8x2_e4m3_bits_to_half2_bits(lo[j] & 0xffffu),
                              fp8x2_e4m3_bits_to_half2_bits(hi[j] & 0xffffu),
                              fp8x2_e4m3_bits_to_half2_bits(lo[j] >> 16),
                              fp8x2_e4m3_bits_to_half2_bits(hi[j] >> 16)};
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint32_t bf[2] = {xw[nt][2 * j], xw[nt][2 * j + 1]};
        mma_f16_16x8x16(part[nt], af, bf);
      }
    }
    const int grp = k0 / a.group;
    const float sl = s_lo[grp], sh = s_hi[grp];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      // This lane's sums are activation rows 8 nt + 2 t and + 1, whose shifts the lanes
      // 8 t and 8 t + 4 (quads 2 t and 2 t + 1) found.
      const float d0 = pow2_neg(warp_shfl(shift[nt], 8 * t)), d1 = pow2_neg(warp_shfl(shift[nt], 8 * t + 4));
      acc[nt][0] += part[nt][0] * (sl * d0);
      acc[nt][1] += part[nt][1] * (sl * d1);
      acc[nt][2] += part[nt][2] * (sh * d0);
      acc[nt][3] += part[nt][3] * (sh * d1);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) cur[i] = next[i];
  }
  allow_dependent_launch();
  mma_tile_store<T, NT>(a, acc, row0);
}

// A single activation row over a large weight (Llama-3-8B's QKV, gate/up, down) stays on the
// CUDA cores, which read those at M = 1 10-25 % faster (H200, 2026-12-04); the tensor cores
// win at M = 1 on weights up to 16 Mi codes (the output projection: 10.8 vs 16.9 us on that
// H200; equal on an H100 since the CUDA-core kernel's prefetch, 9.6 vs 9.6 us) and from 3
// rows on (up to 4.4x at M = 16). Two rows stay on the CUDA cores, whose two-row kernel reads
// every Llama-3-8B layer faster on an H100 (2026-12-07, us, CUDA / tensor cores: QKV 13.8 /
// 14.5, o_proj 8.7 / 9.8, gate/up 45.6 / 55.1, down 24.9 / 27.1). Not re-measured on an H200:
// there, on 2026-12-04 and before the CUDA-core kernel's later changes, only gate/up was
// faster on the CUDA cores at two rows (50.5 / 53.7; QKV 15.8 / 15.3, o_proj 13.0 / 10.9,
// down 27.9 / 26.9). Three rows are not measured: they take the tensor cores, which win at
// four by 25-40 % (H100).
constexpr int64_t kMmaMaxCodesAtOneRow = int64_t(1) << 24;

bool fp8_mma_applies(const QuantGemvArgs& a) {
  const bool rows_fit = a.m > 2 || (a.m == 1 && int64_t(a.n) * a.k <= kMmaMaxCodesAtOneRow);
  return a.tensor_cores && a.code == QuantCode::kFp8 && a.dtype != DType::kFloat32 && a.k % kMmaTrip == 0 &&
         a.group % kMmaTrip == 0 && rows_fit && device_has_mma_f16();
}

// One 16-row tile per warp and one chain of 8 mma per trip. Measured variants (H200,
// 2026-12-04, docs/quantization.md): two tiles per warp sharing the activations was 10-25 %
// slower on the small layers at M = 1-8 (fewer warps, each latency-bound) and no faster on
// the large ones; two chains of 4 mma was slower still (o_proj at M = 1: 21.9 vs 10.8 us).
// Split K within 2,048 warps (see kInt4MmaMaxWarps for what larger limits did to fp8).
constexpr int kFp8MmaMaxWarps = 2048;

template <typename T>
cudaError_t launch_fp8_gemv_mma(const QuantGemvArgs& a, cudaStream_t stream) {
  const int tiles = (a.n + kMmaRowsPerWarp - 1) / kMmaRowsPerWarp;
  const dim3 grid(tiles), block(choose_mma_split(tiles, a.k / kMmaTrip, kFp8MmaMaxWarps) * kWarpSize);
  return a.m <= 8 ? launch_dependent(fp8_gemv_mma_kernel<T, 1>, grid, block, 0, stream, a)
                  : launch_dependent(fp8_gemv_mma_kernel<T, 2>, grid, block, 0, stream, a);
}
#endif  // CORE_HAS_FP8_KV

#ifndef USE_ROCM
// ---- int4 weights on tensor cores (decode rows, fp16/bf16 activations) --------------------
// The CUDA-core kernel turns every int4 code into a float with I2F, a quarter-rate
// instruction on sm_90: at one row it read codes at ~1.5 TB/s on an H100 (2026-12-06), bound
// by that, not by HBM. Here a warp owns 16 output rows and multiplies them with mma.sync
// m16n8k16 in the activations' own type (fp16 x fp16 or bf16 x bf16, fp32 sums), so the
// activations enter as they are, and a weight costs half a LOP3, 3/8 of a shift and half a
// paired FMA (and a PRMT per two activations, shared by the tile's 16 rows):
//
// * a code q (0..15) in the low 4 mantissa bits of the magic number M (1024 in fp16, 128 in
//   bf16: both have a unit in the last place of 1 there) reads as M + q, so one LOP3 makes
//   two of them per 32-bit word, and one paired FMA (x 1 - (M + z)) makes them q - z exactly
//   (|q - z| < 128 fits either type's significand). A word's nibbles (0, 4), (1, 5), (2, 6)
//   and (3, 7) come out as the pairs, from the word shifted by 0, 4, 8 and 12 bits;
// * a dot product may visit its inputs in any order as long as A and B agree: mma step
//   2i + e of a half-trip takes word i's pairs 2e and 2e + 1 as this lane's k-slots
//   (2t, 2t+1 | 2t+8, 2t+9), and B the activations at the same inputs, paired by one PRMT
//   each from the 16-byte vector the lane loads;
// * w = (q - z) * s: the group's scale multiplies the half-trip's fp32 sums once (groups of
//   128 or more inputs). Every product is exact, so only the sums round: closer to the
//   float64 reference than the CUDA-core kernel's fp32 dequantization. (The scale coming
//   last, a half-trip's sum of activations near fp32's limit, ~1e36 x 128 x 15, could
//   overflow where the CUDA-core kernel's would not.)
//
// Zero points z: the caller's `zeros`, bytes [n, k / group] with mins == -z * scale exactly
// (AWQ, GPTQ with groups of 128 or more: platforms/cuda/quant.py finds them; the caller is
// trusted, z < 128 unchecked here); no mins means z = 0. Arbitrary float mins (GGUF Q4_1,
// Q4_K), groups below 128 (GGUF Q4_0's 32) and fp32 activations stay on the CUDA cores.
//
// One trip of the loop covers 256 inputs as two halves of 128: lane (g, t) loads the 32
// codes k0 + 128 h + 32 t .. +32 (16 bytes) of rows g and g + 8, four 16-byte loads per
// trip, with the next trip's codes, zero points and scales in flight (a half's group by
// multiply-high, as in the CUDA-core kernel).
constexpr int kInt4MmaTrip = 256;
constexpr int kInt4MmaHalf = 128;

// The activation type's constants: M (the magic number) and 1.0 in both halves of a word.
template <typename T>
struct Int4Mma {
  static constexpr bool kBf16 = std::is_same<T, Bf16>::value;
  static constexpr uint32_t kMagic = kBf16 ? 0x43004300u : 0x64006400u;  // 128.0 / 1024.0
  static constexpr uint32_t kOne = kBf16 ? 0x3f803f80u : 0x3c003c00u;
};

// -(M + z) in both halves of a word of T's pairs: M + z (z < 128) has M's exponent and z in
// its low mantissa bits, like a code, so it is M's bits plus z with the sign bit set.
template <typename T>
__device__ __forceinline__ uint32_t int4_offset(uint32_t z) {
  return (Int4Mma<T>::kMagic | 0x80008000u) + z * 0x10001u;
}

// Word w's codes minus z as the pairs (0, 4), (1, 5), (2, 6), (3, 7) of T.
template <typename T>
__device__ __forceinline__ void int4_pairs(uint32_t w, uint32_t offset, uint32_t (&p)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    p[j] = fma_pair_bits<Int4Mma<T>::kBf16>(((w >> (4 * j)) & 0x000f000fu) | Int4Mma<T>::kMagic, Int4Mma<T>::kOne,
                                             offset);
  }
}

// The 32 activations at x (16-byte aligned) as B pairs matching int4_pairs: b[i][j] holds
// inputs 8 i + j and 8 i + j + 4. Lanes past the last activation row read row 0 unmasked:
// an mma's output column n depends only on B's column n, and those columns are never stored.
__device__ __forceinline__ void int4_activation_pairs(const uint16_t* x, uint32_t (&b)[4][4]) {
  const uint4* v = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t w[4];
    unpack_words(__ldg(v + i), w);  // (x0, x1) (x2, x3) (x4, x5) (x6, x7)
    b[i][0] = byte_perm(w[0], w[2], 0x5410u);
    b[i][1] = byte_perm(w[0], w[2], 0x7632u);
    b[i][2] = byte_perm(w[1], w[3], 0x5410u);
    b[i][3] = byte_perm(w[1], w[3], 0x7632u);
  }
}

// NT: n-tiles of 8 activation rows (1 for m <= 8, 2 for m <= 16).
template <typename T, int NT>
__global__ void __launch_bounds__(kMmaMaxSplit * kWarpSize)
    int4_gemv_mma_kernel(const QuantGemvArgs a, const GroupOf half_group) {
  const int warp = threadIdx.x / kWarpSize, lane = threadIdx.x % kWarpSize;
  const int split = blockDim.x / kWarpSize;
  const int g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * kMmaRowsPerWarp;
  // Rows past n (the last tile) recompute row n - 1 and are never written.
  const int r_lo = min(row0 + g, a.n - 1), r_hi = min(row0 + g + 8, a.n - 1);
  const uint8_t* w_lo = a.codes + int64_t(r_lo) * (a.k / 2) + 16 * t;
  const uint8_t* w_hi = a.codes + int64_t(r_hi) * (a.k / 2) + 16 * t;
  const int groups = a.k / a.group;
  const float* s_lo = a.scales + int64_t(r_lo) * groups;
  const float* s_hi = a.scales + int64_t(r_hi) * groups;
  const uint8_t* z_lo = a.zeros != nullptr ? a.zeros + int64_t(r_lo) * groups : nullptr;
  const uint8_t* z_hi = a.zeros != nullptr ? a.zeros + int64_t(r_hi) * groups : nullptr;
  const auto* x = static_cast<const uint16_t*>(a.x);
  const uint16_t* x_row[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int m = g + 8 * nt;
    x_row[nt] = x + int64_t(m < a.m ? m : 0) * a.x_stride + 32 * t;
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  const int trips = a.k / kInt4MmaTrip;
  // A trip's codes, zero points and scales; [2 h] / [2 h + 1]: half h's of rows g / g + 8.
  struct Trip {
    uint4 codes[4];
    uint32_t zeros[4];
    float scales[4];
  };
  auto load = [&](int c, Trip& v) {
    const int64_t b = int64_t(c) * (kInt4MmaTrip / 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int grp = half_group(2 * c + h);
      v.codes[2 * h] = __ldg(reinterpret_cast<const uint4*>(w_lo + b + h * (kInt4MmaHalf / 2)));
      v.codes[2 * h + 1] = __ldg(reinterpret_cast<const uint4*>(w_hi + b + h * (kInt4MmaHalf / 2)));
      v.zeros[2 * h] = z_lo != nullptr ? __ldg(z_lo + grp) : 0u;
      v.zeros[2 * h + 1] = z_hi != nullptr ? __ldg(z_hi + grp) : 0u;
      v.scales[2 * h] = __ldg(s_lo + grp);
      v.scales[2 * h + 1] = __ldg(s_hi + grp);
    }
  };
  int c = warp;
  Trip cur{};
  if (c < trips) load(c, cur);
  grid_dependency_wait();  // the first trip is in flight; x comes from the previous kernel
  for (; c < trips; c += split) {
    // The next trip is in flight while this one multiplies. Two in flight was slower (H100,
    // 2026-12-06: gate/up at one row 37.1 -> 42.1 us): the kernel is bound by its issue
    // rate, not by HBM latency, and the extra copies of a trip's registers cost issue slots.
    Trip next{};
    if (c + split < trips) load(c + split, next);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int k0 = c * kInt4MmaTrip + h * kInt4MmaHalf;
      uint32_t b[NT][4][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) int4_activation_pairs(x_row[nt] + k0, b[nt]);
      const uint32_t off_lo = int4_offset<T>(cur.zeros[2 * h]);
      const uint32_t off_hi = int4_offset<T>(cur.zeros[2 * h + 1]);
      uint32_t lo[4], hi[4];
      unpack_words(cur.codes[2 * h], lo);
      unpack_words(cur.codes[2 * h + 1], hi);
      // Two chains of 4 mma a half-trip (mma step e adds into part[e]) instead of one of 8:
      // a dependent mma waits for the one before it. H100, 2026-12-07, us at 8 rows: gate/up
      // 36.4-37.0 -> 35.4-36.0, down 19.3-19.5 -> 17.7-17.9, o_proj 8.2 -> 7.8-7.9; at 2 rows
      // o_proj 7.7-7.8 -> 7.2-7.3; QKV and the other one- and two-row figures within 0.6 us.
      // NT = 1 takes 121 registers instead of 100, NT = 2 136 instead of 138 (no spills); 9-16
      // rows (NT = 2) were not timed.
      float part[2][NT][4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) part[e][nt][0] = part[e][nt][1] = part[e][nt][2] = part[e][nt][3] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        uint32_t pl[4], ph[4];
        int4_pairs<T>(lo[i], off_lo, pl);
        int4_pairs<T>(hi[i], off_hi, ph);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const uint32_t af[4] = {pl[2 * e], ph[2 * e], pl[2 * e + 1], ph[2 * e + 1]};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint32_t bf[2] = {b[nt][i][2 * e], b[nt][i][2 * e + 1]};
            mma_16x8x16<Int4Mma<T>::kBf16>(part[e][nt], af, bf);
          }
        }
      }
      const float sl = cur.scales[2 * h], sh = cur.scales[2 * h + 1];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        acc[nt][0] = fmaf(part[0][nt][0] + part[1][nt][0], sl, acc[nt][0]);
        acc[nt][1] = fmaf(part[0][nt][1] + part[1][nt][1], sl, acc[nt][1]);
        acc[nt][2] = fmaf(part[0][nt][2] + part[1][nt][2], sh, acc[nt][2]);
        acc[nt][3] = fmaf(part[0][nt][3] + part[1][nt][3], sh, acc[nt][3]);
      }
    }
    cur = next;
  }
  allow_dependent_launch();
  mma_tile_store<T, NT>(a, acc, row0);
}

// At one activation row the kernel is bound by latency and issue (ncu on an H200,
// 2026-12-06: no eligible warp in 48 % of cycles, DRAM at 28 % of peak; on an H100 at the
// down projection 14 warps per SM, no eligible warp in 54 %), yet it still reads the large
// weights faster than the CUDA-core kernel, which turns every code into a float (H100,
// 2026-12-06, us at one row, tensor / CUDA cores: gate/up 32.3-33.6 / 37.2, down 17.7 / 21.1,
// QKV 9.8 / 10.2); only the output projection (4,096 x 4,096, 2^24 codes) is faster on the
// CUDA cores (7.7 vs 8.2 us). So one row takes it above kInt4MmaMaxCodesOnCudaCores codes.
constexpr int64_t kInt4MmaMaxCodesOnCudaCores = int64_t(1) << 24;

bool int4_mma_applies(const QuantGemvArgs& a) {
  return a.tensor_cores && a.code == QuantCode::kInt4 && a.dtype != DType::kFloat32 &&
         a.k % kInt4MmaTrip == 0 && a.group % kInt4MmaHalf == 0 && (a.mins == nullptr || a.zeros != nullptr) &&
         (a.m > 1 || int64_t(a.n) * a.k > kInt4MmaMaxCodesOnCudaCores) && device_has_mma_f16();
}

// int4 splits K up to 8,192 warps: the gate/up projection (1,792 tiles of 4,096 inputs) then
// takes four warps a tile instead of one. H100, 2026-12-07, gate/up in us at 1 / 2 / 4 / 8 /
// 16 rows, limit 2,048 -> 4,096 -> 8,192: 32.6 / 33.0 / 33.6 / 35.6 / 71.4 -> 30.5 / 31.3 /
// 32.5 / 35.2 / 58.9 -> 30.8 / 31.6 / 32.9 / 34.8 / 54.4; AWQ TPOT at batch 16 4.84 (4,096) ->
// 4.67 ms (8,192), batch 1 3.10 either way. QKV, o_proj and down keep their splits. (Warps
// keeping only 2 trips made QKV slower: 9.0 -> 9.6 us at one row. fp8 keeps 2,048: there 8,192
// sped gate/up at 4-16 rows by 8-12 % but slowed QKV by 10-13 %, as split 8 replaced 4.)
constexpr int kInt4MmaMaxWarps = 8192;

template <typename T>
cudaError_t launch_int4_gemv_mma(const QuantGemvArgs& a, cudaStream_t stream) {
  GroupOf half_group;
  if (!group_of(a, kInt4MmaHalf, half_group)) return cudaErrorInvalidValue;
  const int tiles = (a.n + kMmaRowsPerWarp - 1) / kMmaRowsPerWarp;
  const dim3 grid(tiles), block(choose_mma_split(tiles, a.k / kInt4MmaTrip, kInt4MmaMaxWarps) * kWarpSize);
  return a.m <= 8 ? launch_dependent(int4_gemv_mma_kernel<T, 1>, grid, block, 0, stream, a, half_group)
                  : launch_dependent(int4_gemv_mma_kernel<T, 2>, grid, block, 0, stream, a, half_group);
}
#endif  // USE_ROCM

template <typename T, QuantCode C>
cudaError_t launch_dequant(const QuantDequantArgs& a, cudaStream_t stream) {
  const int64_t items = int64_t(a.n) * (a.k / Codes<C>::kPer);
  const int64_t blocks = (items + kDequantThreads - 1) / kDequantThreads;
  const int grid = static_cast<int>(blocks < 65536 ? blocks : 65536);  // grid-stride loop beyond
  quant_dequant_kernel<T, C><<<grid, kDequantThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

#if CORE_HAS_FP8_KV
// ---- dynamic FP8 activations ------------------------------------------------------------------
constexpr int kActThreads = 256;
constexpr float kFp8Max = 448.f, kMinAmax = 1e-12f;

// max(amax, 1e-12) / 448 as torch evaluates it (a tensor divided by a Python scalar is a
// multiplication by the scalar's float reciprocal on CUDA), so the scales match the torch
// ops bit for bit; the codes then divide exactly, like torch's tensor / tensor.
__device__ __forceinline__ float act_scale(float amax) {
  return __fmul_rn(fmaxf(amax, kMinAmax), 1.f / kFp8Max);
}

// 8 consecutive elements of row `row` from vector index v (T::kVec elements per 16 bytes:
// one load for fp16/bf16, two for fp32); zeros for padding rows.
template <typename T>
__device__ __forceinline__ void load8(const Fp8ActivationArgs& a, int row, int v, float (&f)[8]) {
  if (row >= a.m) {
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = 0.f;
    return;
  }
  const auto* x = static_cast<const typename T::Storage*>(a.x) + row * a.x_stride + v * 8;
#pragma unroll
  for (int h = 0; h < 8 / T::kVec; ++h) {
    float part[T::kVec];
    T::to_float(*reinterpret_cast<const uint4*>(x + h * T::kVec), part);
#pragma unroll
    for (int i = 0; i < T::kVec; ++i) f[h * T::kVec + i] = part[i];
  }
}

__device__ __forceinline__ void store8(const Fp8ActivationArgs& a, int row, int v, const float (&f)[8], float scale) {
  uint32_t w[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    w[i / 4] |= uint32_t(float_to_fp8_e4m3_bits(__fdiv_rn(f[i], scale))) << (8 * (i % 4));
  }
  *reinterpret_cast<uint2*>(a.codes + int64_t(row) * a.k + v * 8) = make_uint2(w[0], w[1]);
}

// One CTA per row. group == k: the row's max|x| reduced over the CTA, then a second pass over
// the (L1/L2-resident) row quantizes it. group == 128: the 16 consecutive lanes that hold a
// group's 16 vectors of 8 reduce its max with shuffles and quantize at once.
template <typename T>
__global__ void __launch_bounds__(kActThreads) fp8_activations_kernel(const Fp8ActivationArgs a) {
  const int row = blockIdx.x;
  const int vecs = a.k / 8;
  if (a.group != a.k) {  // 128: every trip of the loop is uniform across the CTA (shuffles)
    constexpr int kLanes = 128 / 8;
    for (int base = 0; base < vecs; base += kActThreads) {
      const int v = base + threadIdx.x;
      float f[8];
      float amax = 0.f;
      if (v < vecs) {
        load8<T>(a, row, v, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
      }
#pragma unroll
      for (int off = kLanes / 2; off > 0; off /= 2) amax = fmaxf(amax, warp_shfl_xor(amax, off));
      if (v < vecs) {
        const float scale = act_scale(amax);
        store8(a, row, v, f, scale);
        if (v % kLanes == 0) a.scales[int64_t(v / kLanes) * a.m_total + row] = scale;
      }
    }
    return;
  }
  __shared__ float partial[kActThreads / kWarpSize];
  float amax = 0.f;
  for (int v = threadIdx.x; v < vecs; v += kActThreads) {
    float f[8];
    load8<T>(a, row, v, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(f[i]));
  }
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) amax = fmaxf(amax, warp_shfl_xor(amax, off));
  if (threadIdx.x % kWarpSize == 0) partial[threadIdx.x / kWarpSize] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < kActThreads / kWarpSize; ++w) amax = fmaxf(amax, partial[w]);
  const float scale = act_scale(amax);
  for (int v = threadIdx.x; v < vecs; v += kActThreads) {
    float f[8];
    load8<T>(a, row, v, f);
    store8(a, row, v, f, scale);
  }
  if (threadIdx.x == 0) a.scales[row] = scale;
}
#endif  // CORE_HAS_FP8_KV

// Dispatch over (activation dtype, code) for either launcher.
template <template <typename, QuantCode> class Launch, typename Args>
cudaError_t dispatch(const Args& a, cudaStream_t stream) {
#define CORE_QUANT_CODES(T)                                                        \
  switch (a.code) {                                                                \
    case QuantCode::kInt4: return Launch<T, QuantCode::kInt4>::run(a, stream);      \
    case QuantCode::kInt8: return Launch<T, QuantCode::kInt8>::run(a, stream);      \
    case QuantCode::kFp8: return Launch<T, QuantCode::kFp8>::run(a, stream);        \
  }                                                                                \
  return cudaErrorInvalidValue;
  switch (a.dtype) {
    case DType::kFloat16: { CORE_QUANT_CODES(Fp16) }
    case DType::kBFloat16: { CORE_QUANT_CODES(Bf16) }
    case DType::kFloat32: { CORE_QUANT_CODES(Fp32) }
  }
#undef CORE_QUANT_CODES
  return cudaErrorInvalidValue;
}

template <typename T, QuantCode C>
struct GemvLauncher {
  static cudaError_t run(const QuantGemvArgs& a, cudaStream_t s) { return launch_gemv<T, C>(a, s); }
};

template <typename T, QuantCode C>
struct DequantLauncher {
  static cudaError_t run(const QuantDequantArgs& a, cudaStream_t s) { return launch_dequant<T, C>(a, s); }
};

// The shape contract of quant_gemm.h.
bool valid_shape(int n, int k, int group, QuantCode code) {
  const int per = code == QuantCode::kInt4 ? 32 : 16;
  return n > 0 && k > 0 && k % 32 == 0 && group > 0 && k % group == 0 && group % per == 0;
}

}  // namespace

cudaError_t quant_gemv(const QuantGemvArgs& a, cudaStream_t stream) {
  if (a.m == 0) return cudaSuccess;
  if (a.m < 0 || a.m > kQuantGemvMaxRows || !valid_shape(a.n, a.k, a.group, a.code) ||
      (a.zeros != nullptr && (a.mins == nullptr || a.code != QuantCode::kInt4))) {
    return cudaErrorInvalidValue;  // zeros restate int4 mins: the CUDA cores apply the mins
  }
  const bool paired = a.silu_and_mul || a.rope.heads > 0;  // the CUDA-core kernel's epilogues
  (void)paired;  // unused where neither tensor-core kernel is built
#if CORE_HAS_FP8_KV
  if (!paired && fp8_mma_applies(a)) {
    return a.dtype == DType::kFloat16 ? launch_fp8_gemv_mma<Fp16>(a, stream) : launch_fp8_gemv_mma<Bf16>(a, stream);
  }
#endif
#ifndef USE_ROCM
  if (!paired && int4_mma_applies(a)) {
    return a.dtype == DType::kFloat16 ? launch_int4_gemv_mma<Fp16>(a, stream) : launch_int4_gemv_mma<Bf16>(a, stream);
  }
#endif
  return dispatch<GemvLauncher>(a, stream);
}

bool quant_gemv_tensor_cores(const QuantGemvArgs& a) {
#if CORE_HAS_FP8_KV
  if (fp8_mma_applies(a)) return true;
#endif
#ifndef USE_ROCM
  if (int4_mma_applies(a)) return true;
#endif
  (void)a;
  return false;
}

cudaError_t quant_dequant(const QuantDequantArgs& a, cudaStream_t stream) {
  if (!valid_shape(a.n, a.k, a.group, a.code)) return cudaErrorInvalidValue;
  return dispatch<DequantLauncher>(a, stream);
}

cudaError_t quant_fp8_activations(const Fp8ActivationArgs& a, cudaStream_t stream) {
#if CORE_HAS_FP8_KV
  if (a.m < 0 || a.m_total < a.m || a.k <= 0 || a.k % 8 || (a.group != a.k && (a.group != 128 || a.k % 128))) {
    return cudaErrorInvalidValue;
  }
  if (a.m_total == 0) return cudaSuccess;
  switch (a.dtype) {
    case DType::kFloat16: fp8_activations_kernel<Fp16><<<a.m_total, kActThreads, 0, stream>>>(a); break;
    case DType::kBFloat16: fp8_activations_kernel<Bf16><<<a.m_total, kActThreads, 0, stream>>>(a); break;
    case DType::kFloat32: fp8_activations_kernel<Fp32><<<a.m_total, kActThreads, 0, stream>>>(a); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
#else
  (void)a;
  (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace core_kernels
