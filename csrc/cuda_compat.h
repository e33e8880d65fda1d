// Every difference between CUDA and HIP that the kernels in csrc/ rely on lives here.
//
// The kernels are written once, in CUDA C++, and hipified for ROCm at build time
// (torch.utils.hipify). Nothing outside this header may name a CUDA- or HIP-only
// intrinsic, type or constant: warp size, shuffles, warp barriers, 16-bit float
// conversions, asynchronous global->shared copies and the fast exp2 all go through the
// helpers below. USE_ROCM is defined by torch's build for ROCm.
#pragma once

#include <cstdint>
#include <utility>

#ifdef USE_ROCM
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#else
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

namespace core_kernels {

// ---- warp size -------------------------------------------------------------------------
// CDNA (MI100/MI200/MI300) runs 64-wide wavefronts; NVIDIA: 32. The host pass sizes
// launches and dynamic shared memory from kWarpSize (DecodeShape::kThreads, kSmemBytes) and
// sees no GPU target, so on HIP the value is 64 in every pass. HIP runs 64-wide wavefronts
// on gfx9 targets only (RDNA runs 32-wide ones), so a device pass for any other target
// would disagree with its own launch: it stops here instead.
#ifdef USE_ROCM
constexpr int kWarpSize = 64;
#if defined(__AMDGCN_WAVEFRONT_SIZE)
static_assert(__AMDGCN_WAVEFRONT_SIZE == kWarpSize,
              "csrc/ kernels need 64-wide wavefronts: build for gfx9 (CDNA) targets only, "
              "e.g. PYTORCH_ROCM_ARCH=gfx90a");
#endif
#else
constexpr int kWarpSize = 32;
#endif

// ---- shared-memory copy ring -------------------------------------------------------------
// Stages of a warp's copy ring: with asynchronous copies two units stay in flight while a
// third is consumed; where copies are synchronous (HIP) one stage does the same work, and
// AMD's 64 KiB of LDS per CU could not hold three. Host and device passes must agree on this
// (it sizes the kernel's dynamic shared memory), so it depends on USE_ROCM only.
#ifdef USE_ROCM
constexpr int kCopyStages = 1;
#else
constexpr int kCopyStages = 3;
#endif

// ---- launch bounds -----------------------------------------------------------------------
// `__launch_bounds__(threads, min_blocks)` is CUDA's: at most `threads` per block, and
// registers budgeted so that `min_blocks` blocks stay resident per SM. HIP's macro of the
// same name differs twice: it reads the second argument as waves per SIMD, and, being a
// preprocessor split on commas, it breaks on a templated thread count such as
// `Shape<A, B>::kThreads`. On HIP it is redefined here to pass its arguments to constexpr
// functions (the compiler, not the preprocessor, parses them) and to convert blocks per CU
// into waves per SIMD: a CDNA CU has 4 SIMDs.
#ifdef USE_ROCM
constexpr int kSimdsPerCu = 4;
constexpr int launch_bounds_threads(int threads, int /*min_blocks*/ = 0) { return threads; }
constexpr int launch_bounds_waves_per_simd(int threads, int min_blocks = 0) {
  const int waves_per_block = (threads + kWarpSize - 1) / kWarpSize;
  const int waves = (min_blocks * waves_per_block + kSimdsPerCu - 1) / kSimdsPerCu;
  return waves > 1 ? waves : 1;  // 1 = no constraint beyond fitting one wave
}
#undef __launch_bounds__
#define __launch_bounds__(...)                                                         \
  __attribute__((                                                                      \
      amdgpu_flat_work_group_size(1, ::core_kernels::launch_bounds_threads(__VA_ARGS__)), \
      amdgpu_waves_per_eu(::core_kernels::launch_bounds_waves_per_simd(__VA_ARGS__))))
#endif

// ---- warp collectives ------------------------------------------------------------------
// All lanes of the warp take part (the kernels never call these under divergence).
__device__ __forceinline__ float warp_shfl_xor(float v, int lane_mask) {
#ifdef USE_ROCM
  return __shfl_xor(v, lane_mask, kWarpSize);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask, kWarpSize);
#endif
}

__device__ __forceinline__ int warp_shfl(int v, int src_lane) {
#ifdef USE_ROCM
  return __shfl(v, src_lane, kWarpSize);
#else
  return __shfl_sync(0xffffffffu, v, src_lane, kWarpSize);
#endif
}

__device__ __forceinline__ float warp_shfl(float v, int src_lane) {
#ifdef USE_ROCM
  return __shfl(v, src_lane, kWarpSize);
#else
  return __shfl_sync(0xffffffffu, v, src_lane, kWarpSize);
#endif
}

// True on every lane when `pred` holds on any lane.
__device__ __forceinline__ bool warp_any(bool pred) {
#ifdef USE_ROCM
  return __any(pred);
#else
  return __any_sync(0xffffffffu, pred);
#endif
}

// Orders shared-memory accesses among the lanes of one warp.
__device__ __forceinline__ void warp_sync() {
#ifdef USE_ROCM
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
  __builtin_amdgcn_wave_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
#else
  __syncwarp();
#endif
}

// ---- math ------------------------------------------------------------------------------
// 2^x with the hardware's approximate unit; exp2(-inf) = 0 and exp2(-1e30) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef USE_ROCM
  // v_exp_f32. Clang < 17 has no builtin for it, but there llvm.exp2.f32 lowers to the
  // same single instruction.
#if __has_builtin(__builtin_amdgcn_exp2f)
  return __builtin_amdgcn_exp2f(x);
#else
  return __builtin_exp2f(x);
#endif
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// ---- 16-bit floats, as raw bits ----------------------------------------------------------
// The kernels keep fp16/bf16 data as uint16_t bit patterns so that neither toolkit's
// half/bfloat16 class (nor torch's -D__CUDA_NO_HALF_OPERATORS__ style flags) matter.
// bf16 -> f32 is a shift on both platforms; fp16 goes through the toolkit's intrinsics.
__device__ __forceinline__ float2 half2_bits_to_float2(uint32_t bits) {
  __half2 h;
  static_assert(sizeof(h) == sizeof(bits), "__half2 must be 32 bits");
  __builtin_memcpy(&h, &bits, sizeof(bits));
  return __half22float2(h);
}

__device__ __forceinline__ uint16_t float_to_half_bits(float x) {
  return __half_as_ushort(__float2half_rn(x));
}

// ---- 8-bit floats (e4m3, OCP "fn"), as raw bits -------------------------------------------
// The FP8 KV cache (core/quantization/kv_cache.py) keeps e4m3 codes as uint8_t. CUDA converts
// with the toolkit's intrinsics (one cvt instruction per pair on sm_89+, cuda_fp8.h's software
// path on older targets); both round to nearest even like torch's CPU conversion. HIP builds do
// not instantiate the fp8 cache kernels (CORE_HAS_FP8_KV 0: MI300's native fp8 is e4m3fnuz, a
// different format): the ROCm platform refuses --kv-cache-dtype fp8 at start.
#ifdef USE_ROCM
#define CORE_HAS_FP8_KV 0
#else
#define CORE_HAS_FP8_KV 1

// Two e4m3 codes (the low byte is the first) -> two floats, exactly.
__device__ __forceinline__ float2 fp8x2_e4m3_bits_to_float2(uint16_t bits) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(bits, __NV_E4M3);
  uint32_t w;
  static_assert(sizeof(h) == sizeof(w), "__half2_raw must be 32 bits");
  __builtin_memcpy(&w, &h, sizeof(w));
  return half2_bits_to_float2(w);
}

// Two e4m3 codes (the low byte is the first) -> their fp16 pair (low half first), exactly:
// every e4m3 value, subnormals included, is an fp16 value. One cvt per pair on sm_89+.
__device__ __forceinline__ uint32_t fp8x2_e4m3_bits_to_half2_bits(uint32_t bits) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<uint16_t>(bits), __NV_E4M3);
  uint32_t w;
  __builtin_memcpy(&w, &h, sizeof(w));
  return w;
}

// float -> e4m3 code, rounded to nearest even; beyond +-448 (and +-inf) saturates to +-448,
// NaN stays NaN: the result of torch's clamp(-448, 448).to(float8_e4m3fn).
__device__ __forceinline__ uint8_t float_to_fp8_e4m3_bits(float x) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}
#endif

// ---- fp16 tensor-core tiles (NVIDIA sm_80+) ---------------------------------------------
// Two floats -> their fp16 pair (low half first), rounded to nearest even.
__device__ __forceinline__ uint32_t float2_to_half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  uint32_t w;
  static_assert(sizeof(h) == sizeof(w), "__half2 must be 32 bits");
  __builtin_memcpy(&w, &h, sizeof(w));
  return w;
}

// Bytes of the pair (a, b) picked by the four selector nibbles (0-3: a's bytes, 4-7: b's),
// the lowest nibble giving the result's lowest byte.
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  return __byte_perm(a, b, selector);
}

// c += A (16 x 16, row-major) x B (16 x 8, column-major), both fp16 (kBf16 false) or both
// bf16 (true), fp32 accumulation: one warp-wide mma.sync m16n8k16. Fragments (g = lane / 4,
// t = lane % 4): a[0] = A[g][2t, 2t+1], a[1] = A[g+8][2t, 2t+1], a[2] = A[g][2t+8, 2t+9],
// a[3] = A[g+8][2t+8, 2t+9];
// b[0] = B[2t, 2t+1][g], b[1] = B[2t+8, 2t+9][g]; c = C[g][2t, 2t+1], C[g+8][2t, 2t+1].
// Only kernels that the host launches on sm_80+ call it (CORE_HAS_MMA_F16; elsewhere it traps).
#if !defined(USE_ROCM) && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800)
#define CORE_HAS_MMA_F16 1
#else
#define CORE_HAS_MMA_F16 0
#endif

template <bool kBf16>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CORE_MMA_16X8X16(TYPE)                                                                         \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE                                 \
               ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"                \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
  if constexpr (kBf16) {
    CORE_MMA_16X8X16("bf16");
  } else {
    CORE_MMA_16X8X16("f16");
  }
#undef CORE_MMA_16X8X16
#elif defined(__CUDA_ARCH__)
  (void)c, (void)a, (void)b;
  __trap();
#endif
}

__device__ __forceinline__ void mma_f16_16x8x16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  mma_16x8x16<false>(c, a, b);
}

// a * b + c on a pair of fp16 (kBf16 false) or bf16 (true) values held as bits, rounded once
// to nearest even (sm_80+).
template <bool kBf16>
__device__ __forceinline__ uint32_t fma_pair_bits(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d = 0;
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBf16) {
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  } else {
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  }
#elif defined(__CUDA_ARCH__)
  (void)a, (void)b, (void)c;
  __trap();
#endif
  return d;
}

#ifndef USE_ROCM
// Whether the current device has the fp16 mma.sync above (compute capability 8.0+), cached
// per device; host side (the launchers pick their tensor-core kernels by it).
inline bool device_has_mma_f16() {
  static int cached[64] = {};  // 0 unknown, 1 no, 2 yes; idempotent racy writes are harmless
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) return false;
  if (cached[dev] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cached[dev] = major >= 8 ? 2 : 1;
  }
  return cached[dev] == 2 && CORE_HAS_MMA_F16;
}
#endif

// ---- asynchronous global -> shared copies ------------------------------------------------
// On NVIDIA sm_80+ these are cp.async copies of 16 bytes that bypass L1 and registers,
// grouped by commit and awaited by count. Elsewhere (HIP, older NVIDIA) they degrade to
// ordinary 16-byte loads and stores, which are complete when issued, so the waits are
// no-ops; the kernels' results do not depend on which path runs.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define CORE_HAS_CP_ASYNC 1
#else
#define CORE_HAS_CP_ASYNC 0
#endif

__device__ __forceinline__ void async_copy_16(void* smem_dst, const void* gmem_src) {
#if CORE_HAS_CP_ASYNC
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src));
#else
  *static_cast<uint4*>(smem_dst) = *static_cast<const uint4*>(gmem_src);
#endif
}

__device__ __forceinline__ void async_copy_commit() {
#if CORE_HAS_CP_ASYNC
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void async_copy_wait() {
#if CORE_HAS_CP_ASYNC
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ---- programmatic dependent launch (Hopper) -----------------------------------------------
// A kernel launched with launch_dependent() may start while the previous kernel on the
// stream is finishing; it must call grid_dependency_wait() before reading that kernel's
// results. The previous kernel may call allow_dependent_launch() once its CTAs are past the
// point where an early start of the dependent kernel could take resources they need. Where
// the hardware lacks the feature (HIP, sm < 90) launches are ordinary and these are no-ops.
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CORE_HAS_PDL 1
#else
#define CORE_HAS_PDL 0
#endif

__device__ __forceinline__ void grid_dependency_wait() {
#if CORE_HAS_PDL
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A load that bypasses L1 (which is not coherent between SMs): data another CTA of the same
// grid wrote before a __threadfence() and an atomic that this CTA observed.
__device__ __forceinline__ float load_cg(const float* p) {
#ifdef USE_ROCM
  float r;
  __atomic_load(p, &r, __ATOMIC_RELAXED);
  return r;
#else
  return __ldcg(p);
#endif
}

__device__ __forceinline__ unsigned long long load_cg(const unsigned long long* p) {
#ifdef USE_ROCM
  unsigned long long r;
  __atomic_load(p, &r, __ATOMIC_RELAXED);
  return r;
#else
  return __ldcg(p);
#endif
}

// ---- weight prefetch before the dependency wait -------------------------------------------
// A decode GEMV launched with launch_dependent is resident while the kernel before it (a norm,
// SiLU-and-mul, the attention's reduce: a few microseconds in which HBM is otherwise idle)
// still runs. Its weights do not depend on that kernel, so before grid_dependency_wait() lane
// l of a warp asks L2 for the l-th 128-byte line of each weight row the warp owns, for the
// first `lines` lines of the row (the bytes its first trips read). No register result,
// nothing to wait for; a no-op on HIP.
constexpr int kPrefetchLineBytes = 128;
constexpr int64_t kWeightPrefetchBytes = int64_t(16) << 20;  // per launch, well inside L2

__device__ __forceinline__ void prefetch_row_start(const void* row, int lines, int lane) {
#if !defined(USE_ROCM) && defined(__CUDA_ARCH__)
  if (lane < lines) {
    const char* p = static_cast<const char*>(row) + lane * kPrefetchLineBytes;
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
  }
#endif
}

// Lines per row for a launch over `rows` weight rows of `row_bytes` each: the rows' starts up
// to kWeightPrefetchBytes in all (more would evict what was fetched before it is read), at
// most one line per lane of a warp.
inline int prefetch_lines_per_row(int64_t rows, int64_t row_bytes) {
  if (rows <= 0 || row_bytes <= 0) return 0;
  const int64_t by_budget = kWeightPrefetchBytes / (rows * kPrefetchLineBytes);
  const int64_t whole_row = (row_bytes + kPrefetchLineBytes - 1) / kPrefetchLineBytes;
  int64_t lines = by_budget < whole_row ? by_budget : whole_row;
  return static_cast<int>(lines < kWarpSize ? lines : kWarpSize);
}

__device__ __forceinline__ void allow_dependent_launch() {
#if CORE_HAS_PDL
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace core_kernels

// ---- host side ---------------------------------------------------------------------------
// Plain runtime calls (cudaStream_t, cudaMemcpyAsync, <<<...>>>) are left to hipify; only
// launches whose API differs are wrapped here, and the two names hipify produces that HIP's
// runtime lacks are supplied below.
#ifdef USE_ROCM
// CUDA's runtime takes a typed kernel pointer; HIP's only `const void*`. A typed kernel gets
// this overload (more specialised than any generic one a later HIP may add).
template <typename... Params>
inline hipError_t hipFuncSetAttribute(void (*kernel)(Params...), hipFuncAttribute attr,
                                      int value) {
  return hipFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
// hipify maps cudaErrorMisalignedAddress to this name, which HIP's hipError_t does not have.
// The kernels return it for a host-side argument check, so HIP reports an invalid value.
// (A macro, not a constant: it cannot collide with an enumerator a later HIP may add, as
// HIP's headers are fully included above.)
#define hipErrorMisalignedAddress hipErrorInvalidValue
#endif

namespace core_kernels {

// Launches `kernel` so that it may overlap the tail of the previous kernel on `stream` (see
// grid_dependency_wait). Returns the launch error.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t stream, Args&&... args) {
#ifdef USE_ROCM
  hipLaunchKernelGGL(kernel, grid, block, smem, stream, std::forward<Args>(args)...);
  return hipGetLastError();
#else
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
#endif
}

}  // namespace core_kernels
