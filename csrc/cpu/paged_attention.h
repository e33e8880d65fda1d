// The parts of the paged KV cache ops that every cache dtype shares (paged_attention.cpp):
// argument checks, the slot walk of a cache write, and the decode kernel. The
// float32/bfloat16/float16 ops (paged_attention.cpp) and the float8_e4m3fn ops
// (paged_attention_fp8.cpp) are thin wrappers over these.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace core_cpu {

// A checked write into a [2, blocks, block_size, kv_heads, head_size] cache.
struct KvWrite {
  int64_t row;           // elements of one slot: kv_heads * head_size
  int64_t num_slots;     // blocks * block_size
  int64_t tokens;        // rows of key and value
  const int64_t* slots;  // [tokens] slot of each token; negative: padding, skipped
};

// Checks the cache shape, key/value rows and the slot mapping (dtypes are the caller's).
KvWrite check_kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                       const at::Tensor& slots, const char* op);

// store(token, slot) for every token that is not padding, `grain` tokens per parallel chunk.
template <typename F>
void for_each_written_slot(const KvWrite& w, int64_t grain, F&& store) {
  at::parallel_for(0, w.tokens, grain, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (w.slots[t] >= 0) store(t, w.slots[t]);
    }
  });
}

// The contract of paged_decode over a cache whose keys read as stored * k_scale and values as
// stored * v_scale: a cache of the query's dtype (scales 1) or a float8_e4m3fn one. `op` names
// the caller in errors; the caller checks the scales and which cache dtypes it accepts.
void paged_decode_scaled(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                         const std::optional<at::Tensor>& table_rows, double logits_soft_cap, double k_scale,
                         double v_scale, const char* op);

}  // namespace core_cpu
