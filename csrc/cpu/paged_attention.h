// The parts of the paged KV cache ops that every cache dtype shares (paged_attention.cpp):
// argument checks, the slot walk of a cache write, and the decode kernel. The
// float32/bfloat16/float16 ops (paged_attention.cpp) and the float8_e4m3fn ops
// (paged_attention_fp8.cpp) are thin wrappers over these. No torch headers (as every header of
// csrc/: tests/compile/test_csrc_compiles.py), so at::Tensor is only declared.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

namespace at {
class Tensor;
}  // namespace at

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

// store(token, slot) for every token that is not padding, `grain` tokens per parallel chunk
// (one indirect call per token: a slot's row is kv_heads * head_size elements).
void for_each_written_slot(const KvWrite& w, int64_t grain, const std::function<void(int64_t, int64_t)>& store);

// The contract of paged_decode over a cache whose keys read as stored * k_scale and values as
// stored * v_scale: a cache of the query's dtype (scales 1) or a float8_e4m3fn one. `op` names
// the caller in errors; the caller checks the scales and which cache dtypes it accepts.
void paged_decode_scaled(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window,
                         const std::optional<at::Tensor>& table_rows, double logits_soft_cap, double k_scale,
                         double v_scale, const char* op);

}  // namespace core_cpu
