"""The checkpoint dtype is read without transformers' "`torch_dtype` is deprecated!" warning
(issue 17), from configs written by old and new transformers alike. Each case runs in a
fresh interpreter: transformers warns once per process, so an earlier read elsewhere in
the test session would hide the warning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_dtype_read_without_deprecation_warning(tmp_path, key):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], key: "bfloat16",
              "vocab_size": 300, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = ("from transformers import AutoConfig; from core.engine_core.resolve import _checkpoint_dtype; "
            f"print(_checkpoint_dtype(AutoConfig.from_pretrained({str(tmp_path)!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "torch.bfloat16"
    assert "deprecated" not in r.stderr, r.stderr
