"""Fast access to GGUF files: a tensor index without parsing the metadata arrays, and a
cache of the HF config and tokenizer that ``transformers`` derives from the file.

``gguf.GGUFReader`` builds numpy views of every metadata element; for a 49k-token
vocabulary that costs seconds, and ``transformers`` reads the file that way once for the
config and once for the tokenizer. The weights only need the tensor table, which this
module reads directly (format: github.com/ggml-org/ggml docs/gguf.md); the derived
config and tokenizer are saved once under the cache directory and reloaded from there.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

# metadata value type -> struct format (scalars); 8 = string, 9 = array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: int
    """ggml type id (gguf.GGMLQuantizationType)."""
    shape: tuple[int, ...]
    """numpy order (outermost first): the reverse of GGUF's dims."""
    offset: int
    """absolute byte offset of the data in the file."""
    nbytes: int


class GGUFIndex:
    """Scalar metadata and the tensor table of a GGUF file (arrays are skipped)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        self._parse()

    def _read(self, fmt: str, pos: int) -> tuple[Any, int]:
        value = struct.unpack_from("<" + fmt, self._buf, pos)[0]
        return value, pos + struct.calcsize(fmt)

    def _string(self, pos: int) -> tuple[str, int]:
        n, pos = self._read("Q", pos)
        return self._buf[pos : pos + n].decode("utf-8", errors="replace"), pos + n

    def _skip_value(self, vtype: int, pos: int) -> tuple[Any, int]:
        """Read a scalar or string value; skip arrays (returns None for them)."""
        if vtype in _SCALAR:
            return self._read(_SCALAR[vtype], pos)
        if vtype == _STRING:
            return self._string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF metadata type {vtype} at byte {pos}")
        etype, pos = self._read("I", pos)
        count, pos = self._read("Q", pos)
        if etype in _SCALAR:
            return None, pos + count * struct.calcsize(_SCALAR[etype])
        for _ in range(count):
            _, pos = self._skip_value(etype, pos)
        return None, pos

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        if self._buf[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (magic {self._buf[:4]!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is too old (need 2 or 3)")
        pos = 24
        for _ in range(n_kv):
            key, pos = self._string(pos)
            vtype, pos = self._read("I", pos)
            value, pos = self._skip_value(vtype, pos)
            if value is not None:
                self.metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            ndims, pos = self._read("I", pos)
            dims = struct.unpack_from(f"<{ndims}Q", self._buf, pos)
            pos += 8 * ndims
            qtype, offset = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            infos.append((name, qtype, tuple(reversed(dims)), offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        for name, qtype, shape, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * type_size
            self.tensors.append(GGUFTensor(name, qtype, shape, data_start + offset, nbytes))

    def dequantize(self, t: GGUFTensor) -> np.ndarray:
        """The tensor as float32 (or its native float type) in numpy order."""
        from gguf.constants import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        block, type_size = GGML_QUANT_SIZES[t.qtype]
        row_bytes = t.shape[-1] // block * type_size
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return dequantize(raw.reshape(*t.shape[:-1], row_bytes), t.qtype)

    def raw(self, t: GGUFTensor) -> np.ndarray:
        """The tensor's stored bytes, uint8 ``[*shape[:-1], bytes per row]`` (a view of the
        memory-mapped file), for readers that keep the blocks quantized."""
        from gguf.constants import GGML_QUANT_SIZES

        block, type_size = GGML_QUANT_SIZES[t.qtype]
        raw = np.frombuffer(self._buf, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return raw.reshape(*t.shape[:-1], t.shape[-1] // block * type_size)

    def iter_tensors(self) -> Iterator[tuple[GGUFTensor, np.ndarray]]:
        for t in self.tensors:
            yield t, self.dequantize(t)


def open_index(path: str) -> GGUFIndex:
    """The :class:`GGUFIndex` of ``path``, parsed once per process per file version (the
    engine reads it to choose a weight format and again to load the weights)."""
    st = os.stat(path)
    return _cached_index(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached_index(path: str, size: int, mtime_ns: int) -> GGUFIndex:
    return GGUFIndex(path)


def forget_indexes() -> None:
    """Drop the cached indexes, and with them their maps of the files: once the weights are
    loaded the pages read through the map would stay resident (the whole file) for nothing."""
    _cached_index.cache_clear()


# ---- cache of what transformers derives from the file ------------------------------------------


def cache_dir_for(gguf_path: str, cache_root: str) -> str:
    """Cache folder for one GGUF file, keyed by its path, size and modification time."""
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    return os.path.join(cache_root, "gguf", key)


def _save_atomically(target: str, save: Any) -> None:
    """Run ``save(tmpdir)`` then move the folder into place, so a crash leaves no half cache."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    try:
        save(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race, or no space


def load_gguf_config(gguf_path: str, cache_root: str | None) -> Any:
    from transformers import AutoConfig

    target = os.path.join(cache_dir_for(gguf_path, cache_root), "config") if cache_root else None
    if target and os.path.isfile(os.path.join(target, "config.json")):
        return AutoConfig.from_pretrained(target, local_files_only=True)
    config = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=gguf_path)
    if target:
        _save_atomically(target, config.save_pretrained)
    return config


def load_gguf_tokenizer(gguf_path: str, cache_root: str | None) -> Any:
    from transformers import AutoTokenizer

    target = os.path.join(cache_dir_for(gguf_path, cache_root), "tokenizer") if cache_root else None
    if target and os.path.isfile(os.path.join(target, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(target, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=gguf_path)
    if target:
        _save_atomically(target, tok.save_pretrained)
    return tok
