// KV-cache maintenance: write new tokens (reshape_and_cache), copy blocks for
// copy-on-write across all layers (copy_blocks), and move blocks between device and host
// (swap_blocks). Layout: see launchers.h.
#include "cuda_compat.h"
#include "dtype_traits.cuh"
#include "launchers.h"

namespace core_kernels {

// ---- reshape_and_cache --------------------------------------------------------------------
// One CTA per token; W is the widest word that every row start and stride is aligned to.
template <typename W>
__global__ void reshape_and_cache_kernel(const ReshapeAndCacheArgs a) {
  const int t = blockIdx.x;
  const int64_t slot = a.slot_mapping[t];
  if (slot < 0) return;  // padding token: never written
  const int64_t block = slot / a.block_size;
  const int offset = static_cast<int>(slot % a.block_size);
  const int64_t row_bytes = int64_t(a.head_size) * a.elem_size;
  const int64_t tile_bytes = row_bytes * a.block_size;   // one (block, kv head)
  const int64_t kv_bytes = tile_bytes * a.num_kv_heads;  // keys -> values
  char* dst_k = static_cast<char*>(a.kv_cache) + block * 2 * kv_bytes + offset * row_bytes;
  const char* key = static_cast<const char*>(a.key);
  const char* value = static_cast<const char*>(a.value);
  const int words_per_row = static_cast<int>(row_bytes / sizeof(W));
  const int words = a.num_kv_heads * words_per_row;
  for (int i = threadIdx.x; i < words; i += blockDim.x) {
    const int h = i / words_per_row;
    const int w = i % words_per_row;
    const W* k = reinterpret_cast<const W*>(key + (t * a.key_stride_tok + h * a.key_stride_head) *
                                                      a.elem_size) +
                 w;
    const W* v = reinterpret_cast<const W*>(
                     value + (t * a.value_stride_tok + h * a.value_stride_head) * a.elem_size) +
                 w;
    W* dk = reinterpret_cast<W*>(dst_k + h * tile_bytes) + w;
    W* dv = reinterpret_cast<W*>(dst_k + kv_bytes + h * tile_bytes) + w;
    *dk = *k;
    *dv = *v;
  }
}

#if CORE_HAS_FP8_KV
// FP8 cache: one CTA per token, one thread per element (rows are a few hundred bytes; the
// write is a sliver of a step). Each code is fp8(x * inv_scale) with saturation, the rounding
// of torch's clamp(-448, 448).to(float8_e4m3fn) (core/quantization/kv_cache.py).
template <typename ST>
__global__ void reshape_and_cache_fp8_kernel(const ReshapeAndCacheArgs a) {
  const int t = blockIdx.x;
  const int64_t slot = a.slot_mapping[t];
  if (slot < 0) return;  // padding token: never written
  const int64_t block = slot / a.block_size;
  const int offset = static_cast<int>(slot % a.block_size);
  const int64_t tile = int64_t(a.head_size) * a.block_size;  // bytes of one (block, kv head)
  const int64_t kv = tile * a.num_kv_heads;                   // keys -> values
  uint8_t* dst = static_cast<uint8_t*>(a.kv_cache) + block * 2 * kv + offset * a.head_size;
  const auto* key = static_cast<const typename ST::Storage*>(a.key);
  const auto* value = static_cast<const typename ST::Storage*>(a.value);
  for (int i = threadIdx.x; i < a.num_kv_heads * a.head_size; i += blockDim.x) {
    const int h = i / a.head_size;
    const int d = i % a.head_size;
    const float k = ST::to_float1(key[t * a.key_stride_tok + h * a.key_stride_head + d]);
    const float v = ST::to_float1(value[t * a.value_stride_tok + h * a.value_stride_head + d]);
    dst[h * tile + d] = float_to_fp8_e4m3_bits(k * a.k_inv_scale);
    dst[kv + h * tile + d] = float_to_fp8_e4m3_bits(v * a.v_inv_scale);
  }
}
#endif

static cudaError_t reshape_and_cache_fp8(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
#if CORE_HAS_FP8_KV
  const int n = a.num_kv_heads * a.head_size;
  const int threads = n >= 256 ? 256 : ((n + 31) / 32) * 32;
  switch (a.src_dtype) {
    case DType::kFloat16:
      reshape_and_cache_fp8_kernel<Fp16><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
    case DType::kBFloat16:
      reshape_and_cache_fp8_kernel<Bf16><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
    case DType::kFloat32:
      reshape_and_cache_fp8_kernel<Fp32><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
  }
  return cudaGetLastError();
#else
  (void)a;
  (void)stream;
  return cudaErrorInvalidValue;  // not built for ROCm: the platform refuses an fp8 cache
#endif
}

// Largest power-of-two word size (<= 16 bytes) dividing every byte offset in `offsets`.
static int common_alignment(const int64_t* offsets, int n) {
  int64_t bits = 16;
  for (int i = 0; i < n; ++i) bits |= offsets[i];
  return static_cast<int>(bits & -bits);
}

cudaError_t reshape_and_cache(const ReshapeAndCacheArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.cache_fp8) return reshape_and_cache_fp8(a, stream);
  const int64_t e = a.elem_size;
  const int64_t offsets[] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.key)),
                             static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.value)),
                             static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.kv_cache)),
                             a.key_stride_tok * e,
                             a.key_stride_head * e,
                             a.value_stride_tok * e,
                             a.value_stride_head * e,
                             a.head_size * e};
  const int align = common_alignment(offsets, 8);
  const int words = a.num_kv_heads * static_cast<int>(a.head_size * e / align);
  const int threads = words >= 256 ? 256 : ((words + 31) / 32) * 32;
  switch (align) {
    case 16:
      reshape_and_cache_kernel<uint4><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
    case 8:
      reshape_and_cache_kernel<uint2><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
    case 4:
      reshape_and_cache_kernel<uint32_t><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
    default:
      reshape_and_cache_kernel<uint16_t><<<a.num_tokens, threads, 0, stream>>>(a);
      break;
  }
  return cudaGetLastError();
}

// ---- copy_blocks ---------------------------------------------------------------------------
struct LayerCaches {
  uint4* base[kMaxCopyLayers];  // passed by value: no host->device copy of the pointer table
};

// grid (pairs, layers): CTA (p, l) copies block pairs[2p] -> pairs[2p + 1] of layer l.
__global__ void copy_blocks_kernel(const LayerCaches layers, const int64_t* pairs,
                                   int64_t block_words) {
  uint4* base = layers.base[blockIdx.y];
  const uint4* src = base + pairs[2 * blockIdx.x] * block_words;
  uint4* dst = base + pairs[2 * blockIdx.x + 1] * block_words;
  for (int64_t i = threadIdx.x; i < block_words; i += blockDim.x) dst[i] = src[i];
}

cudaError_t copy_blocks(void* const* layer_caches, int num_layers, const int64_t* pairs,
                        int num_pairs, int64_t block_bytes, cudaStream_t stream) {
  if (num_layers == 0 || num_pairs == 0) return cudaSuccess;
  if (block_bytes % 16 != 0) return cudaErrorInvalidValue;
  for (int first = 0; first < num_layers; first += kMaxCopyLayers) {
    LayerCaches layers{};
    const int n = num_layers - first < kMaxCopyLayers ? num_layers - first : kMaxCopyLayers;
    for (int l = 0; l < n; ++l) {
      if (reinterpret_cast<uintptr_t>(layer_caches[first + l]) % 16 != 0) {
        return cudaErrorMisalignedAddress;
      }
      layers.base[l] = static_cast<uint4*>(layer_caches[first + l]);
    }
    const dim3 grid(num_pairs, n);
    copy_blocks_kernel<<<grid, 256, 0, stream>>>(layers, pairs, block_bytes / 16);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// ---- swap_blocks -----------------------------------------------------------------------------
cudaError_t swap_blocks(const void* src, void* dst, const int64_t* pairs_host, int num_pairs,
                        int64_t block_bytes, cudaStream_t stream) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  int p = 0;
  while (p < num_pairs) {
    // Extend a run while both sides stay consecutive: one DMA per run, not per block.
    int n = 1;
    while (p + n < num_pairs && pairs_host[2 * (p + n)] == pairs_host[2 * p] + n &&
           pairs_host[2 * (p + n) + 1] == pairs_host[2 * p + 1] + n) {
      ++n;
    }
    const cudaError_t err = cudaMemcpyAsync(d + pairs_host[2 * p + 1] * block_bytes,
                                            s + pairs_host[2 * p] * block_bytes, n * block_bytes,
                                            cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return err;
    p += n;
  }
  return cudaSuccess;
}

}  // namespace core_kernels
