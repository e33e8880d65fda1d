// Meta (shape-only) implementations of the core_C ops. Every op mutates tensors it is given
// and returns nothing, so the fake-tensor pass of torch.compile only needs to know that the
// op exists and that its arguments have the right rank; sizes may be symbolic there, so only
// ranks are checked.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

void reshape_and_cache_meta(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                            const at::Tensor& slot_mapping, double, double) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && kv_cache.dim() == 5 && slot_mapping.dim() == 1,
              "reshape_and_cache: expected key/value [tokens, kv_heads, head], a 5-d cache and "
              "1-d slot_mapping");
}

void paged_decode_meta(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double, int64_t,
                       int64_t, int64_t, double, double, double, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(out.dim() == 3 && query.dim() == 3 && kv_cache.dim() == 5 &&
                  block_tables.dim() == 2 && seq_lens.dim() == 1,
              "paged_decode: expected out/query [seqs, heads, head], a 5-d cache, 2-d "
              "block_tables and 1-d seq_lens");
}

void paged_decode_and_cache_meta(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                                 const at::Tensor& value, const at::Tensor& slot_mapping,
                                 at::Tensor& kv_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double, int64_t, int64_t, int64_t,
                                 double, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(out.dim() == 3 && query.dim() == 3 && key.dim() == 3 && value.dim() == 3 &&
                  slot_mapping.dim() == 1 && kv_cache.dim() == 5 && block_tables.dim() == 2 &&
                  seq_lens.dim() == 1,
              "paged_decode_and_cache: expected out/query/key/value [seqs, heads, head], 1-d "
              "slot_mapping, a 5-d cache, 2-d block_tables and 1-d seq_lens");
}

void copy_blocks_meta(at::TensorList kv_caches, const at::Tensor& block_mapping) {
  TORCH_CHECK(block_mapping.dim() == 2, "copy_blocks: block_mapping must be [n, 2]");
  for (const at::Tensor& c : kv_caches) {
    TORCH_CHECK(c.dim() == 5, "copy_blocks: every kv cache must be 5-d");
  }
}

void swap_blocks_meta(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(src.dim() == dst.dim() && block_mapping.dim() == 2,
              "swap_blocks: caches of one rank and a [n, 2] block_mapping expected");
}

}  // namespace

TORCH_LIBRARY_IMPL(core_C, Meta, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_meta);
  m.impl("paged_decode", &paged_decode_meta);
  m.impl("paged_decode_and_cache", &paged_decode_and_cache_meta);
  m.impl("copy_blocks", &copy_blocks_meta);
  m.impl("swap_blocks", &swap_blocks_meta);
}
