"""Greedy agreement of a tiny block-scaled FP8 checkpoint on CUDA (bf16) with the CPU (fp32):
W8A8 prefill (``torch._scaled_mm``, activations quantized per token and 128 inputs) against the
same checkpoint with prefill dequantized to bf16 (``block_scaled_rows`` patched to 0), AWQ, and
the unquantized model (docs/quantization.md, "Not done yet"). On the GPU machine:

    PYTHONPATH=. python3 docs/benchmarks/fp8_block_agreement.py
"""
import sys, tempfile, pathlib
sys.path.insert(0, ".")
import platforms.cuda.quant as q
from core.quantization.writers import write_quantized
from tests.helpers import tiny_llama_dir
from tests.integration.test_engine_hf import random_prompts
from tests.cuda.test_cuda_quant import _greedy, _agreement
tmp = pathlib.Path(tempfile.mkdtemp())
src = tiny_llama_dir(tmp, name="src", seed=7, hidden_size=256, intermediate_size=512,
                     num_attention_heads=4, num_key_value_heads=2)
prompts = random_prompts(6, 512, seed=3)
for fmt in ["fp8-block", "awq"]:
    path = write_quantized(src, tmp / fmt, fmt)
    cpu = _greedy(path, "cpu", prompts)
    print(fmt, "w8a8/kept prefill agreement", round(_agreement(_greedy(path, "cuda", prompts), cpu), 3), flush=True)
    if fmt == "fp8-block":
        real = q.block_scaled_rows
        q.block_scaled_rows = lambda device: 0
        print(fmt, "dequantized-prefill agreement", round(_agreement(_greedy(path, "cuda", prompts), cpu), 3), flush=True)
        q.block_scaled_rows = real
# bf16 dense (unquantized source) on CUDA vs fp32 CPU: the floor any bf16 run has here
print("dense bf16", "agreement", round(_agreement(_greedy(src, "cuda", prompts), _greedy(src, "cpu", prompts)), 3))
