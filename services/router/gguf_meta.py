"""Read the scalar metadata of a GGUF file (context length, vocab size) without tensors.

``gguf.GGUFReader`` memory-maps every field and takes ~15 s on a 49k-token vocabulary;
this reader walks the key/value section once, skipping arrays, in milliseconds.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO, Union

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _read(fh: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = fh.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF file")
    return struct.unpack(fmt, data)[0]


def _read_str(fh: BinaryIO) -> str:
    n = _read(fh, "<Q")
    return fh.read(n).decode("utf-8", errors="replace")


def _read_value(fh: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(fh, _SCALARS[vtype])
    if vtype == _STRING:
        return _read_str(fh)
    if vtype == _ARRAY:
        etype, count = _read(fh, "<I"), _read(fh, "<Q")
        if etype in _SCALARS:
            fh.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
        elif etype == _STRING:
            for _ in range(count):
                fh.seek(_read(fh, "<Q"), 1)
        else:
            for _ in range(count):
                _read_value(fh, etype)
        return ArrayInfo(etype, count)
    raise ValueError(f"unknown GGUF value type {vtype}")


class ArrayInfo:
    """Stands in for an array value: only its element type and length are kept."""

    def __init__(self, etype: int, count: int) -> None:
        self.etype, self.count = etype, count

    def __len__(self) -> int:
        return self.count


def read_metadata(path: Union[str, Path]) -> dict[str, Any]:
    """Every metadata key of a GGUF file; arrays become ``ArrayInfo`` (length only)."""
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        _read(fh, "<I")  # version
        _read(fh, "<Q")  # tensor count
        kv_count = _read(fh, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _read_str(fh)
            meta[key] = _read_value(fh, _read(fh, "<I"))
    return meta


def context_length(meta: dict[str, Any]) -> int:
    arch = meta.get("general.architecture", "llama")
    return int(meta.get(f"{arch}.context_length", 2048))


def vocab_size(meta: dict[str, Any]) -> int:
    arch = meta.get("general.architecture", "llama")
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    tokens = meta.get("tokenizer.ggml.tokens")
    return len(tokens) if tokens is not None else 0
