// A whole decode step of a Llama-shaped model in one call: torch.classes.core_cpu.DecodeStack.
//
// A batch-1 decode step of SmolLM2-135M makes ~330 kernel calls through ~120 Python module
// calls; on two cores that Python cost (~6 ms) was as large as the weight streaming itself.
// This object holds the layers' tensors (references to the model's own parameters, packed
// weights and KV caches, nothing copied) and runs the layer loop in C++, calling the very
// kernels the modules call, in the same order, on the same inputs: its result is the modules'
// bit for bit (tests/unit/test_cpu_decode_stack.py). platforms/cpu/decode_stack.py decides which
// models and steps it takes; everything else runs the modules.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops.h"

namespace core_cpu {
namespace {

constexpr int64_t kQuantGroupSize = 32;  // Int4Codec.group_size

// One weight of platforms/cpu/linear.py (GroupedQuant for float32 models: quant_linear; PackedInt4
// for bfloat16 ones: torch's int4 kernel), and the layer's bias (may be undefined).
struct Linear {
  at::Tensor codes, scales;
  std::optional<at::Tensor> mins;
  at::Tensor bias;
  int64_t bits = 4, out_features = 0;
  bool int4pack = false;  // codes: torch's packed int4 [out, in / 2]; scales: scales_and_zeros [in / 32, out, 2]
};

// [codes, scales, mins, bias]: an empty tensor stands for "none" (mins of int8, no bias).
Linear make_linear(const std::vector<at::Tensor>& parts, const char* what) {
  TORCH_CHECK(parts.size() == 4, "DecodeStack: ", what, " takes [codes, scales, mins, bias], got ", parts.size(),
              " tensors");
  Linear l;
  l.codes = parts[0];
  l.scales = parts[1];
  l.bits = l.codes.scalar_type() == at::kByte ? 4 : 8;
  l.int4pack = l.scales.dim() == 3;
  if (parts[2].numel() > 0) l.mins = parts[2];
  if (parts[3].numel() > 0) l.bias = parts[3];
  l.out_features = l.codes.size(0);
  return l;
}

struct Layer {
  at::Tensor in_norm, post_norm, kv_cache;
  double eps = 0.0, scale = 1.0, soft_cap = 0.0;
  int64_t heads = 0, kv_heads = 0, head_size = 0, window = 0;
  Linear qkv, o, gate_up, down;
};

}  // namespace

class DecodeStack : public torch::CustomClassHolder {
 public:
  // embedding: [table] (dense rows), or [codes, scales] of int8 codes in groups of 32 (a table
  // released for its exact codes: QuantizedLinear.prepare_embedding), whose looked-up rows are
  // dequantized as QuantizedLinear.embed does.
  DecodeStack(std::vector<at::Tensor> embedding, at::Tensor final_norm, double final_eps, at::Tensor cos_sin_cache,
              int64_t rotary_dim, int64_t act_mode)
      : final_norm_(std::move(final_norm)), final_eps_(final_eps), cos_sin_(std::move(cos_sin_cache)),
        rotary_dim_(rotary_dim), act_mode_(act_mode) {
    TORCH_CHECK(embedding.size() == 1 || embedding.size() == 2,
                "DecodeStack: the embedding takes [table] or [int8 codes, scales], got ", embedding.size(),
                " tensors");
    embedding_ = embedding[0];
    if (embedding.size() == 2) embed_scales_ = embedding[1];
  }

  void add_layer(at::Tensor in_norm, at::Tensor post_norm, double eps, std::vector<at::Tensor> qkv,
                 std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down,
                 at::Tensor kv_cache, int64_t heads, int64_t kv_heads, int64_t head_size, double scale,
                 int64_t window, double soft_cap) {
    Layer l;
    l.in_norm = std::move(in_norm);
    l.post_norm = std::move(post_norm);
    l.kv_cache = std::move(kv_cache);
    l.eps = eps;
    l.scale = scale;
    l.soft_cap = soft_cap;
    l.heads = heads;
    l.kv_heads = kv_heads;
    l.head_size = head_size;
    l.window = window;
    l.qkv = make_linear(qkv, "qkv");
    l.o = make_linear(o, "o");
    l.gate_up = make_linear(gate_up, "gate_up");
    l.down = make_linear(down, "down");
    TORCH_CHECK(l.qkv.out_features == (heads + 2 * kv_heads) * head_size,
                "DecodeStack: qkv has ", l.qkv.out_features, " outputs, not (", heads, " + 2 x ", kv_heads, ") x ",
                head_size);
    layers_.push_back(std::move(l));
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // input_ids/positions/slots [T] int64, block_tables [T, blocks] int32, seq_lens [T] int32
  // (one new token per sequence) -> the final-normed hidden states [T, hidden] float32.
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& slots) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers added");
    at::Tensor x = embed(input_ids), residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      at::Tensor h = at::empty_like(x);
      if (i == 0) {
        rms_norm(h, x, l.in_norm, l.eps);
        residual = x;
      } else {
        residual = add_norm(h, x, residual, l.in_norm, l.eps);
      }
      at::Tensor attn = attention(l, h, positions, block_tables, seq_lens, slots);
      at::Tensor o = linear(l.o, attn);
      residual = add_norm(h, o, residual, l.post_norm, l.eps);
      at::Tensor gu = linear(l.gate_up, h);
      at::Tensor act = at::empty({gu.size(0), gu.size(1) / 2}, gu.options());
      silu_and_mul(act, gu);
      x = linear(l.down, act);
    }
    at::Tensor out = at::empty_like(x);
    add_norm(out, x, residual, final_norm_, final_eps_);
    return out;
  }

 private:
  // out = norm(x + residual); returns the new residual (LlamaDecoderLayer's fused norms).
  static at::Tensor add_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& residual,
                             const at::Tensor& weight, double eps) {
    at::Tensor next = at::empty_like(x);
    fused_add_rms_norm(out, next, x, residual, weight, eps);
    return next;
  }

  at::Tensor embed(const at::Tensor& ids) const {
    if (!embed_scales_.defined()) return at::embedding(embedding_, ids);
    at::Tensor out = at::empty({ids.numel(), embedding_.size(1)}, embed_scales_.options().dtype(at::kFloat));
    quant_dequantize(out, embedding_.index_select(0, ids), embed_scales_.index_select(0, ids), std::nullopt, 8);
    return out;
  }

  at::Tensor linear(const Linear& w, const at::Tensor& x) const {
    if (w.int4pack) {  // as QuantizedLinear.apply: torch's kernel, then the bias (not in place)
      at::Tensor out = at::_weight_int4pack_mm_for_cpu(x, w.codes, kQuantGroupSize, w.scales);
      return w.bias.defined() ? out + w.bias : out;
    }
    at::Tensor out = at::empty({x.size(0), w.out_features}, x.options());
    quant_linear(out, x, w.codes, w.scales, w.mins, w.bits, act_mode_);
    if (w.bias.defined()) out.add_(w.bias);
    return out;
  }

  // LlamaAttention + CpuPagedAttentionBackend for a decode-only step: [T, hidden] -> [T, H * D].
  at::Tensor attention(const Layer& l, const at::Tensor& h, const at::Tensor& positions,
                       const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& slots) const {
    const int64_t t = h.size(0), d = l.head_size, q_size = l.heads * d, kv_size = l.kv_heads * d;
    at::Tensor qkv = linear(l.qkv, h);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({t, l.heads, d});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, l.kv_heads, d});
    at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, l.kv_heads, d});
    at::Tensor q_rot = at::empty({t, l.heads, d}, qkv.options());
    at::Tensor k_rot = at::empty({t, l.kv_heads, d}, qkv.options());
    rotary_embedding(q_rot, k_rot, positions, q, k, cos_sin_, rotary_dim_);
    at::Tensor cache = l.kv_cache;  // the kernels take it by reference; the storage is shared
    write_kv(k_rot, v, cache, slots);
    at::Tensor out = at::empty_like(q_rot);
    paged_decode(out, q_rot, cache, block_tables, seq_lens, l.scale, l.window, std::nullopt, l.soft_cap);
    return out.view({t, q_size});
  }

  at::Tensor embedding_, embed_scales_, final_norm_;
  double final_eps_;
  at::Tensor cos_sin_;
  int64_t rotary_dim_, act_mode_;
  std::vector<Layer> layers_;
};

TORCH_LIBRARY_FRAGMENT(core_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, at::Tensor, double, at::Tensor, int64_t, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
}

}  // namespace core_cpu
