// Schemas of the core_C ops, and the Python module init of the prebuilt extension.
//
// Implementations are registered per dispatch key in ops_cuda.cpp (CUDA) and ops_meta.cpp
// (Meta: shape-only, used by torch.compile's fake tensors). Every op writes into tensors the
// caller owns and returns nothing, so it can be captured in a CUDA graph.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(core_C, m) {
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "float k_scale=1.0, float v_scale=1.0) -> ()");
  m.def(
      "paged_decode(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int max_seq_len, int partition_size, "
      "int sliding_window, float logits_soft_cap=0.0, float k_scale=1.0, float v_scale=1.0, "
      "Tensor(c!)? part_count=None) -> ()");
  m.def(
      "paged_decode_and_cache(Tensor(a!) out, Tensor query, Tensor key, Tensor value, "
      "Tensor slot_mapping, Tensor(b!) kv_cache, Tensor block_tables, Tensor seq_lens, "
      "float scale, int max_seq_len, int partition_size, int sliding_window, "
      "float logits_soft_cap=0.0, Tensor(c!)? part_count=None) -> ()");
  m.def("copy_blocks(Tensor(a!)[] kv_caches, Tensor block_mapping) -> ()");
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
}

// Importing the prebuilt extension (platforms.cuda._C) runs the registrations above; the
// module itself is empty. A JIT build loads the same library with torch.ops.load_library.
#define CORE_CONCAT_(a, b) a##b
#define CORE_CONCAT(a, b) CORE_CONCAT_(a, b)
#define CORE_STR_(a) #a
#define CORE_STR(a) CORE_STR_(a)

PyMODINIT_FUNC CORE_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT,
                               CORE_STR(TORCH_EXTENSION_NAME),
                               nullptr,
                               -1,
                               nullptr,
                               nullptr,
                               nullptr,
                               nullptr,
                               nullptr};
  return PyModule_Create(&module);
}
