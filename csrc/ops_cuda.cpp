// CUDA implementations of the core_C ops: check the tensors, then call the raw launchers.
// Errors name the tensor, what was found and what is expected.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "launchers.h"

namespace {

using core_kernels::DType;

// Error messages are assembled without iostreams. The H200 image's compiler wrapper links
// libstdc++ statically into the extension, and that copy's stream/locale objects are never
// initialised in the host process: formatting a number through them (what c10::str does)
// crashed. std::to_string and string concatenation do not touch locales.
std::string str(int64_t v) { return std::to_string(v); }
std::string str(const char* s) { return s; }
std::string str(const std::string& s) { return s; }
std::string str(at::ScalarType t) { return c10::toString(t); }
std::string str(const at::Device& d) { return d.str(); }
std::string str(at::IntArrayRef values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

template <typename... Parts>
std::string msg(const Parts&... parts) {
  std::string out;
  ((out += str(parts)), ...);
  return out;
}

DType kernel_dtype(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    default:
      break;
  }
  TORCH_CHECK(false, msg(what, " has dtype ", t.scalar_type(),
                         "; the CUDA kernels support float16, bfloat16 and float32"));
  return DType::kFloat32;  // unreachable: TORCH_CHECK(false) throws
}

bool is_fp8_cache(const at::Tensor& kv_cache) {
  return kv_cache.scalar_type() == at::kFloat8_e4m3fn;
}

void check_kv_scale(double s, const char* what) {
  TORCH_CHECK(s > 0.0 && s < 1e30, msg(what, " must be a positive finite number (the FP8 cache's "
                                       "per-layer scale); got ", std::to_string(s)));
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, msg("core_C.", op, " failed: ", cudaGetErrorString(err)));
}

void check_cache(const at::Tensor& kv_cache) {
  TORCH_CHECK(kv_cache.is_cuda() && kv_cache.dim() == 5 && kv_cache.size(1) == 2 &&
                  kv_cache.is_contiguous(),
              msg("kv_cache must be a contiguous CUDA tensor [num_blocks, 2, num_kv_heads, "
                  "block_size, head_size]; got shape ",
                  kv_cache.sizes(), " on ", kv_cache.device(),
                  kv_cache.is_contiguous() ? "" : " (not contiguous)"));
  const int64_t bs = kv_cache.size(3);
  TORCH_CHECK(
      bs >= 16 && (bs & (bs - 1)) == 0,
      msg("kv_cache block size ", bs, " is not a power of two >= 16; use block size 16 or 32"));
}

// [tokens, heads, head_size] rows the kernels read or write 16 bytes at a time.
void check_rows(const at::Tensor& t, const char* what) {
  const int64_t e = t.element_size();
  TORCH_CHECK(t.dim() == 3,
              msg(what, " must be [num_tokens, num_heads, head_size]; got shape ", t.sizes()));
  TORCH_CHECK(t.stride(2) == 1 && (t.stride(1) * e) % 16 == 0 && (t.stride(0) * e) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
              msg(what, " rows must be contiguous and 16-byte aligned; got strides ", t.strides(),
                  " (call .contiguous() on it)"));
}

void check_int_vector(const at::Tensor& t, const char* what, at::ScalarType type, int64_t dims,
                      const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == type && t.dim() == dims && t.device() == device,
              msg(what, " must be a ", dims, "-d ", type, " tensor on ", device, "; got ",
                  t.scalar_type(), " of shape ", t.sizes(), " on ", t.device()));
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  check_cache(kv_cache);
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(),
              msg("key and value must both be [num_tokens, num_kv_heads, head_size]; got ",
                  key.sizes(), " and ", value.sizes()));
  TORCH_CHECK(
      key.size(1) == kv_cache.size(2) && key.size(2) == kv_cache.size(4),
      msg("key is [", key.size(0), ", ", key.size(1), ", ", key.size(2), "] but the cache holds ",
          kv_cache.size(2), " kv heads of size ", kv_cache.size(4)));
  const bool fp8 = is_fp8_cache(kv_cache);
  TORCH_CHECK(
      fp8 ? key.scalar_type() == value.scalar_type()
          : key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
      msg("key/value dtypes (", key.scalar_type(), ", ", value.scalar_type(),
          fp8 ? ") must be one dtype over the cache dtype " : ") must equal the cache dtype ",
          kv_cache.scalar_type()));
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1,
              "key and value must be contiguous in head_size");
  TORCH_CHECK(key.device() == kv_cache.device() && value.device() == kv_cache.device(),
              msg("key/value on ", key.device(), "/", value.device(), " but the cache is on ",
                  kv_cache.device()));
  const at::Tensor slots = slot_mapping.contiguous();
  check_int_vector(slots, "slot_mapping", at::kLong, 1, kv_cache.device());
  TORCH_CHECK(slots.size(0) == key.size(0),
              msg("slot_mapping has ", slots.size(0), " entries for ", key.size(0), " tokens"));
  if (fp8) {
    check_kv_scale(k_scale, "k_scale");
    check_kv_scale(v_scale, "v_scale");
  } else {
    kernel_dtype(kv_cache, "kv_cache");
  }
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  core_kernels::ReshapeAndCacheArgs a{};
  a.cache_fp8 = fp8 ? 1 : 0;
  a.src_dtype = kernel_dtype(key, "key");
  a.k_inv_scale = static_cast<float>(1.0 / k_scale);  // as core/quantization/kv_cache.py
  a.v_inv_scale = static_cast<float>(1.0 / v_scale);
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.kv_cache = kv_cache.data_ptr();
  a.slot_mapping = slots.data_ptr<int64_t>();
  a.key_stride_tok = key.stride(0);
  a.key_stride_head = key.stride(1);
  a.value_stride_tok = value.stride(0);
  a.value_stride_head = value.stride(1);
  a.num_tokens = static_cast<int>(key.size(0));
  a.num_kv_heads = static_cast<int>(key.size(1));
  a.head_size = static_cast<int>(key.size(2));
  a.block_size = static_cast<int>(kv_cache.size(3));
  a.elem_size = static_cast<int>(kv_cache.element_size());
  check_launch(core_kernels::reshape_and_cache(a, c10::cuda::getCurrentCUDAStream()),
               "reshape_and_cache");
}

void check_decode_inputs(const at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  check_cache(kv_cache);
  check_rows(query, "query");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              msg("out ", out.sizes(), " ", out.scalar_type(), " must match query ", query.sizes(),
                  " ", query.scalar_type()));
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() || is_fp8_cache(kv_cache),
              msg("query dtype ", query.scalar_type(), " differs from the cache dtype ",
                  kv_cache.scalar_type()));
  const int64_t head = kv_cache.size(4);
  TORCH_CHECK(query.size(2) == head && (head == 64 || head == 128 || head == 256),
              msg("head size ", query.size(2), " (cache: ", head,
                  ") is not supported; the kernels take 64, 128 or 256"));
  TORCH_CHECK(head != 256 || kv_cache.scalar_type() != at::kFloat,
              "head size 256 is supported in bfloat16, float16 and fp8 caches only, not float32");
#ifdef USE_ROCM
  TORCH_CHECK(head != 256 || query.size(1) / kv_cache.size(2) <= 4,
              msg("head size 256 on ROCm takes query groups of at most 4; got ",
                  query.size(1) / kv_cache.size(2), " query heads per kv head"));
#endif
  TORCH_CHECK(
      query.size(1) % kv_cache.size(2) == 0,
      msg(query.size(1), " query heads are not a multiple of ", kv_cache.size(2), " kv heads"));
  TORCH_CHECK(query.device() == kv_cache.device() && out.device() == kv_cache.device(),
              msg("query/out must be on the cache's device ", kv_cache.device()));
  check_int_vector(block_tables, "block_tables", at::kInt, 2, kv_cache.device());
  check_int_vector(seq_lens, "seq_lens", at::kInt, 1, kv_cache.device());
  TORCH_CHECK(block_tables.stride(1) == 1, "block_tables rows must be contiguous");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              msg("decode batch of ", query.size(0), " sequences but block_tables has ",
                  block_tables.size(0), " rows and seq_lens ", seq_lens.size(0), " entries"));
}

// Fills the decode arguments `a` leaves open, allocates v2's scratch and launches.
void launch_decode(core_kernels::DecodeArgs& a, at::Tensor& out, const at::Tensor& query,
                   const at::Tensor& kv_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                   int64_t partition_size, int64_t sliding_window, double logits_soft_cap,
                   double k_scale, double v_scale, const c10::optional<at::Tensor>& part_count,
                   const char* op) {
  check_decode_inputs(out, query, kv_cache, block_tables, seq_lens);
  const bool fp8 = is_fp8_cache(kv_cache);
  if (fp8) {
    check_kv_scale(k_scale, "k_scale");
    check_kv_scale(v_scale, "v_scale");
  }
  TORCH_CHECK(logits_soft_cap >= 0.0,
              msg("logits_soft_cap ", logits_soft_cap, " must be 0 (no capping) or positive"));
  TORCH_CHECK(partition_size >= 0 && partition_size % 16 == 0,
              msg("partition_size ", partition_size,
                  " must be 0 (single pass) or a positive multiple of 16"));
  const at::Tensor lens = seq_lens.contiguous();
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  a.out = out.data_ptr();
  a.query = query.data_ptr();
  a.kv_cache = kv_cache.data_ptr();
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.seq_lens = lens.data_ptr<int32_t>();
  a.q_stride_tok = query.stride(0);
  a.q_stride_head = query.stride(1);
  a.o_stride_tok = out.stride(0);
  a.o_stride_head = out.stride(1);
  a.bt_stride = block_tables.stride(0);
  a.num_seqs = static_cast<int>(query.size(0));
  a.num_q_heads = static_cast<int>(query.size(1));
  a.num_kv_heads = static_cast<int>(kv_cache.size(2));
  a.head_size = static_cast<int>(query.size(2));
  a.block_size = static_cast<int>(kv_cache.size(3));
  a.block_shift = 0;
  while ((1 << a.block_shift) < a.block_size) ++a.block_shift;
  a.partition = static_cast<int>(partition_size);
  a.sliding_window = static_cast<int>(sliding_window);
  // Over an fp8 cache the key scale joins the softmax scale and the value scale multiplies
  // the output (paged_decode.cuh); other caches ignore both.
  a.scale = static_cast<float>(fp8 ? scale * k_scale : scale);
  a.v_scale = fp8 ? static_cast<float>(v_scale) : 1.f;
  a.kv_fp8 = fp8 ? 1 : 0;
  a.soft_cap = static_cast<float>(logits_soft_cap);
  a.dtype = kernel_dtype(query, "query");
  at::Tensor part_out, part_max, part_sum;  // v2 scratch, from the caching allocator
  if (partition_size > 0) {
    TORCH_CHECK(max_seq_len >= 0, msg("max_seq_len must be >= 0; got ", max_seq_len));
    const int64_t parts = std::max<int64_t>(1, (max_seq_len + partition_size - 1) / partition_size);
    TORCH_CHECK(parts <= 12288, msg("max_seq_len ", max_seq_len, " needs ", parts,
                                    " partitions of ", partition_size,
                                    " tokens; at most 12288 are supported, "
                                    "use a larger partition_size"));
    const auto f32 = query.options().dtype(at::kFloat);
    part_out = at::empty({query.size(0), query.size(1), parts, query.size(2)}, f32);
    part_max = at::empty({query.size(0), query.size(1), parts}, f32);
    part_sum = at::empty({query.size(0), query.size(1), parts}, f32);
    a.part_out = part_out.data_ptr<float>();
    a.part_max = part_max.data_ptr<float>();
    a.part_sum = part_sum.data_ptr<float>();
    a.max_parts = static_cast<int>(parts);
    if (part_count.has_value()) {
      // Arrival counts for the merge in the main kernel (launchers.h, DecodeArgs::part_count):
      // the caller's zeros, which every launch leaves zero.
      const at::Tensor& c = *part_count;
      check_int_vector(c, "part_count", at::kInt, 1, kv_cache.device());
      TORCH_CHECK(c.is_contiguous() && c.numel() >= query.size(0) * query.size(1),
                  msg("part_count must be a contiguous int32 tensor of at least sequences x "
                      "query heads = ", query.size(0) * query.size(1), " zeros; got ", c.numel(),
                      " elements"));
      a.part_count = c.data_ptr<int32_t>();
    }
  }
  check_launch(core_kernels::paged_decode(a, c10::cuda::getCurrentCUDAStream()), op);
}

void paged_decode(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                  int64_t max_seq_len, int64_t partition_size, int64_t sliding_window,
                  double logits_soft_cap, double k_scale, double v_scale,
                  const c10::optional<at::Tensor>& part_count) {
  core_kernels::DecodeArgs a{};
  launch_decode(a, out, query, kv_cache, block_tables, seq_lens, scale, max_seq_len,
                partition_size, sliding_window, logits_soft_cap, k_scale, v_scale, part_count,
                "paged_decode");
}

// paged_decode that first stores each sequence's newest token (key/value [seqs, kv_heads,
// head_size], slot_mapping [seqs]) in the cache, as reshape_and_cache would, inside the decode
// kernel (one launch instead of two), and overlaps the previous kernel under programmatic
// dependent launch: block_tables, seq_lens and slot_mapping are read before waiting for it, so
// they must not be written by the kernel just before (the step's metadata never is).
void paged_decode_and_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, const at::Tensor& slot_mapping,
                            at::Tensor& kv_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, int64_t max_seq_len,
                            int64_t partition_size, int64_t sliding_window,
                            double logits_soft_cap, const c10::optional<at::Tensor>& part_count) {
  check_cache(kv_cache);
  TORCH_CHECK(!is_fp8_cache(kv_cache),
              "paged_decode_and_cache does not write fp8 caches (their write quantizes): use "
              "reshape_and_cache, then paged_decode");
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) &&
                  key.size(1) == kv_cache.size(2) && key.size(2) == kv_cache.size(4),
              msg("key ", key.sizes(), " and value ", value.sizes(), " must be [", query.size(0),
                  ", ", kv_cache.size(2), ", ", kv_cache.size(4),
                  "]: one new token per decoded sequence"));
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() &&
                  value.scalar_type() == kv_cache.scalar_type() &&
                  key.device() == kv_cache.device() && value.device() == kv_cache.device(),
              msg("key/value must have the cache's dtype ", kv_cache.scalar_type(),
                  " and device ", kv_cache.device()));
  check_int_vector(slot_mapping, "slot_mapping", at::kLong, 1, kv_cache.device());
  TORCH_CHECK(slot_mapping.is_contiguous() && seq_lens.is_contiguous() &&
                  slot_mapping.size(0) == query.size(0),
              msg("slot_mapping (", slot_mapping.size(0), " entries for ", query.size(0),
                  " sequences) and seq_lens must be contiguous: the kernel reads them before "
                  "waiting for the previous kernel, so no copy may be made here"));
  core_kernels::DecodeArgs a{};
  a.new_key = key.data_ptr();
  a.new_value = value.data_ptr();
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.nk_stride_tok = key.stride(0);
  a.nk_stride_head = key.stride(1);
  a.nv_stride_tok = value.stride(0);
  a.nv_stride_head = value.stride(1);
  a.overlap_previous = 1;
  launch_decode(a, out, query, kv_cache, block_tables, seq_lens, scale, max_seq_len,
                partition_size, sliding_window, logits_soft_cap, 1.0, 1.0, part_count,
                "paged_decode_and_cache");
}

// [n, 2] int64 (src, dst) block pairs; validated against num_blocks when on the host.
void check_pairs(const at::Tensor& pairs, int64_t src_blocks, int64_t dst_blocks) {
  TORCH_CHECK(pairs.scalar_type() == at::kLong && pairs.dim() == 2 && pairs.size(1) == 2,
              msg("block_mapping must be an int64 [n, 2] tensor of (src, dst) block ids; got ",
                  pairs.scalar_type(), " of shape ", pairs.sizes()));
  if (!pairs.is_cpu() || pairs.numel() == 0) return;
  const at::Tensor c = pairs.contiguous();
  const auto mins = std::get<0>(c.min(0)), maxs = std::get<0>(c.max(0));
  const int64_t lo = std::min(mins[0].item<int64_t>(), mins[1].item<int64_t>());
  TORCH_CHECK(
      lo >= 0 && maxs[0].item<int64_t>() < src_blocks && maxs[1].item<int64_t>() < dst_blocks,
      msg("block_mapping ids must lie in [0, ", src_blocks, ") for the source and [0, ", dst_blocks,
          ") for the destination; got src max ", maxs[0].item<int64_t>(), ", dst max ",
          maxs[1].item<int64_t>(), ", min ", lo));
}

void copy_blocks(at::TensorList kv_caches, const at::Tensor& block_mapping) {
  if (kv_caches.empty() || block_mapping.numel() == 0) return;
  const at::Tensor& first = kv_caches[0];
  check_cache(first);
  std::vector<void*> layers;
  layers.reserve(kv_caches.size());
  for (const at::Tensor& c : kv_caches) {
    TORCH_CHECK(c.sizes() == first.sizes() && c.scalar_type() == first.scalar_type() &&
                    c.device() == first.device() && c.is_contiguous(),
                msg("all kv_caches must be contiguous and share shape, dtype and device; got ",
                    c.sizes(), " ", c.scalar_type(), " on ", c.device(), " vs ", first.sizes(), " ",
                    first.scalar_type(), " on ", first.device()));
    layers.push_back(c.data_ptr());
  }
  check_pairs(block_mapping, first.size(0), first.size(0));
  const at::Tensor pairs = block_mapping.to(first.device(), /*non_blocking=*/true).contiguous();
  const c10::cuda::CUDAGuard guard(first.device());
  check_launch(core_kernels::copy_blocks(layers.data(), static_cast<int>(layers.size()),
                                         pairs.data_ptr<int64_t>(), static_cast<int>(pairs.size(0)),
                                         first.stride(0) * first.element_size(),
                                         c10::cuda::getCurrentCUDAStream()),
               "copy_blocks");
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  TORCH_CHECK(
      src.dim() >= 2 && src.sizes().slice(1) == dst.sizes().slice(1) &&
          src.scalar_type() == dst.scalar_type() && src.is_contiguous() && dst.is_contiguous(),
      msg("swap_blocks needs two contiguous caches of one block layout and dtype; got ",
          src.sizes(), " ", src.scalar_type(), " and ", dst.sizes(), " ", dst.scalar_type()));
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "swap_blocks: neither cache is on a CUDA device");
  const at::Tensor pairs = block_mapping.to(at::kCPU).contiguous();
  check_pairs(pairs, src.size(0), dst.size(0));
  if (pairs.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  check_launch(
      core_kernels::swap_blocks(src.data_ptr(), dst.data_ptr(), pairs.data_ptr<int64_t>(),
                                static_cast<int>(pairs.size(0)), src.stride(0) * src.element_size(),
                                c10::cuda::getCurrentCUDAStream()),
      "swap_blocks");
}

}  // namespace

TORCH_LIBRARY_IMPL(core_C, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_and_cache", &paged_decode_and_cache);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("swap_blocks", &swap_blocks);
}
