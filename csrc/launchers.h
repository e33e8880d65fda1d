// Host entry points of the kernels in csrc/: plain C++ over raw pointers, sizes and
// strides, with the stream to launch on. No torch types cross this line, so the device
// code compiles (and is compile-checked in CI) without torch's headers; the torch op
// registration in *.cpp files checks tensors and calls these.
//
// KV-cache layout shared by every kernel (one tensor per layer):
//   [num_blocks, 2, num_kv_heads, block_size, head_size], contiguous.
// A block's keys and values are one contiguous span (so swaps and copies move one span per
// block), and the keys of one (block, kv head) are a contiguous [block_size, head_size]
// tile (so decode streams them with 16-byte coalesced loads).
#pragma once

#include <cstdint>

#ifdef USE_ROCM
#include <hip/hip_runtime_api.h>
#else
#include <cuda_runtime_api.h>
#endif

namespace core_kernels {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

// Size in bytes of one element of `dtype`.
inline int dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// The rotary embedding a decode GEMV may apply in its epilogue (gemv.h, quant/quant_gemm.h;
// heads > 0): the weight is a fused QKV projection whose first `heads` heads of head_size rows
// (query heads, then key heads) are rotated as the rotary_embedding op (fused_ops.h) rotates
// them: features i and i + rotary_dim / 2 of a head by cos_sin[positions[m]], each rounded to
// the storage dtype first; the rows after them (value heads) are plain.
struct RopeSpec {
  const int64_t* positions;  // [m]
  const float* cos_sin;      // [max position, rotary_dim]: cos then sin halves
  int heads, head_size, rotary_dim;
};

// Whether `r` describes heads that fit a weight of n rows, paired two rows at a time.
inline bool rope_spec_fits(const RopeSpec& r, int n) {
  return r.heads > 0 && r.head_size > 0 && r.head_size % 2 == 0 && r.rotary_dim > 0 && r.rotary_dim % 2 == 0 &&
         r.rotary_dim <= r.head_size && int64_t(r.heads) * r.head_size <= n && n % 2 == 0 &&
         r.positions != nullptr && r.cos_sin != nullptr;
}

// ---- paged decode attention ----------------------------------------------------------------
// Strides are in elements. One query token per sequence.
struct DecodeArgs {
  void* out;                    // [num_seqs, num_q_heads, head_size], last dim contiguous
  const void* query;            // [num_seqs, num_q_heads, head_size], last dim contiguous
  const void* kv_cache;         // layout above
  const int32_t* block_tables;  // [num_seqs, bt_stride]
  const int32_t* seq_lens;      // [num_seqs]; tokens to attend to (>= 0)
  float* part_out;              // v2 only: [num_seqs, num_q_heads, max_parts, head_size]
  float* part_max;              // v2 only: [num_seqs, num_q_heads, max_parts] (log2 domain)
  float* part_sum;              // v2 only: [num_seqs, num_q_heads, max_parts]
  int64_t q_stride_tok, q_stride_head;
  int64_t o_stride_tok, o_stride_head;
  int64_t bt_stride;
  int num_seqs, num_q_heads, num_kv_heads, head_size, block_size;
  int block_shift;     // log2(block_size): block sizes are powers of two
  int partition;       // 0: single pass (v1); else tokens per partition (v2), % 16 == 0
  int max_parts;       // v2: partitions of the longest sequence (grid size)
  int sliding_window;  // 0: none; else attend to the last `sliding_window` tokens
  float scale;         // softmax scale applied to q.k (times k_scale over an fp8 cache)
  float soft_cap;      // 0: none; else scaled scores s become soft_cap * tanh(s / soft_cap)
  float v_scale;       // multiplies the output: the fp8 cache's value scale, else 1
  DType dtype;         // of query and out (and of the cache unless kv_fp8)
  int kv_fp8;          // 1: the cache holds float8 e4m3 codes (core/quantization/kv_cache.py)
  // Fused cache write (paged_decode_and_cache; null new_key: the cache already holds every
  // token). Each sequence's newest token (position seq_lens - 1) has its key/value rows
  // [num_kv_heads, head_size] here, written to the cache at slot_mapping[seq] (< 0: padding,
  // not written) by the CTAs whose range ends the context, before they read that position.
  // Not with an fp8 cache (its write quantizes: reshape_and_cache).
  const void* new_key;
  const void* new_value;
  const int64_t* slot_mapping;  // [num_seqs]
  int64_t nk_stride_tok, nk_stride_head, nv_stride_tok, nv_stride_head;
  // v2 only, optional: [>= num_seqs * num_q_heads] int32 arrival counts, all zero on entry and
  // left zero by every launch. Given, the partitions of one (sequence, kv head, head tile) are
  // merged by the CTA that finishes last (and a single partition writes the output itself)
  // instead of by the reduce kernel: one kernel fewer per layer. Null: the reduce kernel.
  // Ignored on ROCm and by the fp8 tensor-core kernel (they launch the reduce kernel).
  int32_t* part_count;
  // 1: launched under programmatic dependent launch, overlapping the previous kernel (the
  // rotary embedding that produced q and the new key). The kernel reads seq_lens and
  // block_tables before waiting for that kernel, so they must be ready before it was launched.
  int overlap_previous;
};

// Launches v1 (args.partition == 0) or v2 (split-KV kernel + reduce kernel). Returns the
// launch error, if any. Requires head_size in {64, 128} (or 256 in fp16/bf16, or over an fp8
// cache; on ROCm with query groups of at most 4), block_size a power of two >= 16,
// 16-byte aligned rows, and num_q_heads % num_kv_heads == 0. An fp8 cache (kv_fp8) is not
// built for ROCm (cudaErrorInvalidValue there).
cudaError_t paged_decode(const DecodeArgs& args, cudaStream_t stream);

// Per-dtype halves of paged_decode, one translation unit each (they compile in parallel).
cudaError_t paged_decode_fp16(const DecodeArgs& args, cudaStream_t stream);
cudaError_t paged_decode_bf16(const DecodeArgs& args, cudaStream_t stream);
cudaError_t paged_decode_fp32(const DecodeArgs& args, cudaStream_t stream);
// Any query dtype over an fp8 cache.
cudaError_t paged_decode_fp8(const DecodeArgs& args, cudaStream_t stream);

// ---- cache ops --------------------------------------------------------------------------------
// Writes token t's key/value rows ([num_kv_heads, head_size], strides in elements, last dim
// contiguous) into the cache at slot_mapping[t] = block * block_size + offset. Tokens with a
// negative slot are padding and are skipped. An fp8 cache (cache_fp8) stores each element x of
// key (value) as fp8_e4m3(x * k_inv_scale) (v_inv_scale), saturated to +-448 and rounded to
// nearest even, from key/value of src_dtype; otherwise the rows are copied as they are.
struct ReshapeAndCacheArgs {
  const void* key;
  const void* value;
  void* kv_cache;
  const int64_t* slot_mapping;
  int64_t key_stride_tok, key_stride_head;
  int64_t value_stride_tok, value_stride_head;
  int num_tokens, num_kv_heads, head_size, block_size, elem_size;
  int cache_fp8;      // 1: the cache holds float8 e4m3 codes (elem_size is then key's)
  DType src_dtype;    // of key/value when cache_fp8
  float k_inv_scale;  // float32(1 / k_scale), multiplied (core/quantization/kv_cache.py)
  float v_inv_scale;
};
cudaError_t reshape_and_cache(const ReshapeAndCacheArgs& args, cudaStream_t stream);

// For every layer l < num_layers and pair p < num_pairs, copies block pairs[2p] of layer l
// onto block pairs[2p + 1] of the same layer; `pairs` lives on the device. All layers go in
// one launch per kMaxCopyLayers layers. Destinations must be distinct and never a source.
constexpr int kMaxCopyLayers = 256;
cudaError_t copy_blocks(void* const* layer_caches, int num_layers, const int64_t* pairs,
                        int num_pairs, int64_t block_bytes, cudaStream_t stream);

// Copies whole blocks between two caches of the same layout (device<->host, or within a
// device): src block pairs_host[2p] -> dst block pairs_host[2p + 1]. `pairs_host` is host
// memory; consecutive runs (src+1, dst+1) are merged into one copy. Host memory should be
// pinned for the copies to be asynchronous.
cudaError_t swap_blocks(const void* src, void* dst, const int64_t* pairs_host, int num_pairs,
                        int64_t block_bytes, cudaStream_t stream);

}  // namespace core_kernels
