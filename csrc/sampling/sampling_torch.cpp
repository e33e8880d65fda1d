// Torch registration of the fused sampler (schema, CUDA and Meta implementations). Like the
// other core_C ops it writes into tensors the caller allocates and returns nothing. The
// Python wrapper (platforms/cuda/sampling.py) packs the per-row parameters and edits
// (core/sampler/kernel.py) and allocates the outputs.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "sampling.h"

namespace {

// Messages are built without iostreams (see the note in ops_cuda.cpp).
std::string shape(const at::Tensor& t) {
  std::string out = "[";
  for (int64_t i = 0; i < t.dim(); ++i) out += (i ? ", " : "") + std::to_string(t.size(i));
  return out + "]";
}

void check(const at::Tensor& t, const char* what, at::ScalarType dtype, int64_t rows,
           int64_t cols, const at::Tensor& like) {
  const bool ok = t.device() == like.device() && t.scalar_type() == dtype && t.is_contiguous() &&
                  t.dim() == (cols < 0 ? 1 : 2) && (rows < 0 || t.size(0) == rows) &&
                  (cols < 0 || t.size(1) == cols);
  TORCH_CHECK(ok, std::string("core_C.sample_rows: ") + what + " " + shape(t) + " (" +
                      c10::toString(t.scalar_type()) + ") must be a contiguous " +
                      c10::toString(dtype) + " tensor of shape [" +
                      (rows < 0 ? std::string("n") : std::to_string(rows)) +
                      (cols < 0 ? std::string("") : ", " + std::to_string(cols)) +
                      "] on the logits' device");
}

void sample_rows(at::Tensor& tokens, at::Tensor& logprobs, at::Tensor& lse,
                 const at::Tensor& logits, const at::Tensor& rowf, const at::Tensor& rowi,
                 const at::Tensor& edits, const at::Tensor& state, int64_t vocab, int64_t splits,
                 const c10::optional<at::Tensor>& part, const c10::optional<at::Tensor>& arrivals) {
  TORCH_CHECK(logits.is_cuda() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1,
              "core_C.sample_rows: logits " + shape(logits) +
                  " must be a 2-D float32 CUDA tensor with contiguous rows");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(vocab >= 1 && vocab <= logits.size(1) && vocab < (int64_t{1} << 30),
              "core_C.sample_rows: vocab " + std::to_string(vocab) + " must be in [1, " +
                  std::to_string(logits.size(1)) + "] (the logits' columns) and below 2^30");
  check(rowf, "rowf", at::kDouble, rows, core_sampling::kRowF, logits);
  check(rowi, "rowi", at::kInt, rows, core_sampling::kRowI, logits);
  check(edits, "edits", at::kInt, -1, core_sampling::kEditFields, logits);
  check(tokens, "tokens", at::kLong, rows, -1, logits);
  check(logprobs, "logprobs", at::kFloat, rows, -1, logits);
  check(lse, "lse", at::kFloat, rows, -1, logits);
  TORCH_CHECK(rows < (int64_t{1} << 31), "core_C.sample_rows: too many rows");
  // Penalty state: empty (no row reads one) or [state rows, width >= vocab] int32 whose
  // rows start 16-byte aligned (width a multiple of 4): the kernel reads it with int4 loads.
  const bool has_state = state.numel() > 0;
  if (has_state) {
    check(state, "state", at::kInt, -1, state.dim() == 2 ? state.size(1) : 4, logits);
    TORCH_CHECK(state.size(1) >= vocab && state.size(1) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(state.data_ptr<int32_t>()) % 16 == 0,
                "core_C.sample_rows: state " + shape(state) + " needs a row width >= vocab " +
                    std::to_string(vocab) + " that is a multiple of 4, 16-byte aligned");
  }
  // Split rows: a workspace of sizeof(Stats) bytes per block and zeroed int32 arrival counts
  // the kernel leaves at zero (the caller keeps and reuses both).
  TORCH_CHECK(splits >= 1 && splits <= core_kernels::kSampleThreads,
              "core_C.sample_rows: splits " + std::to_string(splits) + " must be in [1, " +
                  std::to_string(core_kernels::kSampleThreads) + "] (blocks per row)");
  TORCH_CHECK(rows * splits < (int64_t{1} << 31), "core_C.sample_rows: rows x splits must be below 2^31");
#ifdef USE_ROCM
  TORCH_CHECK(splits == 1, "core_C.sample_rows: splits " + std::to_string(splits) +
                               " > 1 is not built for ROCm (csrc/sampling/sampling.cu); pass 1");
#endif
  if (splits > 1) {
    const int64_t need = rows * splits * static_cast<int64_t>(sizeof(core_sampling::Stats));
    TORCH_CHECK(part.has_value() && part->device() == logits.device() && part->is_contiguous() &&
                    part->numel() * part->element_size() >= need &&
                    reinterpret_cast<uintptr_t>(part->data_ptr()) % 8 == 0,
                "core_C.sample_rows: splits " + std::to_string(splits) + " needs part, a contiguous " +
                    "8-byte aligned tensor of at least " + std::to_string(need) +
                    " bytes on the logits' device");
    TORCH_CHECK(arrivals.has_value() && arrivals->device() == logits.device() &&
                    arrivals->scalar_type() == at::kInt && arrivals->is_contiguous() &&
                    arrivals->numel() >= rows,
                "core_C.sample_rows: splits " + std::to_string(splits) +
                    " needs arrivals, a contiguous int32 tensor of at least " + std::to_string(rows) +
                    " zeros on the logits' device");
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  core_sampling::SampleArgs a{};
  a.splits = static_cast<int>(splits);
  a.part = splits > 1 ? static_cast<core_sampling::Stats*>(part->data_ptr()) : nullptr;
  a.arrivals = splits > 1 ? reinterpret_cast<unsigned*>(arrivals->data_ptr<int32_t>()) : nullptr;
  a.logits = logits.data_ptr<float>();
  a.ld = logits.stride(0);
  a.rows = static_cast<int>(rows);
  a.vocab = static_cast<int>(vocab);
  a.vec4 = reinterpret_cast<uintptr_t>(a.logits) % 16 == 0 && a.ld % 4 == 0;
  a.rowf = rowf.data_ptr<double>();
  a.rowi = rowi.data_ptr<int32_t>();
  a.edits = edits.numel() ? edits.data_ptr<int32_t>() : nullptr;
  a.state = has_state ? state.data_ptr<int32_t>() : nullptr;
  a.state_ld = has_state ? state.size(1) : 0;
  a.tokens = tokens.data_ptr<int64_t>();
  a.logprobs = logprobs.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  const cudaError_t err =
      core_kernels::sample_rows(a, c10::cuda::getCurrentCUDAStream(logits.get_device()));
  TORCH_CHECK(err == cudaSuccess,
              std::string("core_C.sample_rows failed: ") + cudaGetErrorString(err));
}

void sample_rows_meta(at::Tensor& tokens, at::Tensor& logprobs, at::Tensor& lse,
                      const at::Tensor& logits, const at::Tensor& rowf, const at::Tensor& rowi,
                      const at::Tensor& edits, const at::Tensor&, int64_t, int64_t,
                      const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(logits.dim() == 2 && rowf.dim() == 2 && rowi.dim() == 2 && edits.dim() == 2 &&
                  tokens.dim() == 1 && logprobs.dim() == 1 && lse.dim() == 1,
              "core_C.sample_rows: expected 2-d logits/rowf/rowi/edits and 1-d outputs");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(core_C, m) {
  m.def(
      "sample_rows(Tensor(a!) tokens, Tensor(b!) logprobs, Tensor(c!) lse, Tensor logits, "
      "Tensor rowf, Tensor rowi, Tensor edits, Tensor state, int vocab, int splits=1, "
      "Tensor(d!)? part=None, Tensor(e!)? arrivals=None) -> ()");
}

TORCH_LIBRARY_IMPL(core_C, CUDA, m) { m.impl("sample_rows", &sample_rows); }

TORCH_LIBRARY_IMPL(core_C, Meta, m) { m.impl("sample_rows", &sample_rows_meta); }
