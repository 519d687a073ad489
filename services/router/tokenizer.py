"""The router's view of the model: its config and tokenizer, never its weights.

Tokenizer and chat template are the engine's (``common.model.tokenizer``), so the router
tokenizes exactly as the workers detokenize, and the ``ModelConfig`` is the engine's, so
the block-key fingerprint matches theirs. Sources, fastest first:

1. a named dummy config (byte tokenizer);
2. the engine loader's disk cache (``gguf-<key>.json``: config + tokenizer spec);
3. the router's own cache (``router-<key>.json``), written once from the GGUF metadata
   with the engine's readers (~30 s; tensors are never read);
4. an HF checkpoint directory (config.json, tokenizer.json).
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from jinja2.exceptions import TemplateError

from common.model import loader
from common.model.arch import UnsupportedModelError
from common.model.config import DUMMY_CONFIGS, ModelConfig
from common.model.tokenizer import ByteTokenizer, Tokenizer
from common.service import StartupError
from services.router.tool_calls import tools_prompt

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger(__name__)

TokenizerSpec = Optional[dict[str, Any]]


def _read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _write_json(path: str, data: dict[str, Any]) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)  # atomic: a concurrent reader sees all or nothing
    except OSError as exc:
        log.warning("cannot cache the model metadata at %s: %s", path, exc)


def _gguf_meta(path: str) -> tuple[ModelConfig, TokenizerSpec]:
    key = loader._cache_key(path)  # noqa: SLF001 - the engine cache's own key
    for name in (f"gguf-{key}.json", f"router-{key}.json"):
        meta = _read_json(os.path.join(loader.cache_dir(), name))
        if meta is not None and "config" in meta and "tokenizer" in meta:
            return ModelConfig.from_dict(meta["config"]), meta["tokenizer"]
    from gguf import GGUFReader

    from common.model.gguf_loader import read_config, read_tokenizer

    log.info("reading model metadata from %s (one time, ~30 s)", os.path.basename(path))
    reader = GGUFReader(path)
    config = read_config(reader, os.path.basename(path).removesuffix(".gguf"), path)
    spec = read_tokenizer(path, reader)
    _write_json(os.path.join(loader.cache_dir(), f"router-{key}.json"),
                {"config": config.to_dict(), "tokenizer": spec, "source": path})
    return config, spec


def _hf_meta(path: str) -> tuple[ModelConfig, TokenizerSpec]:
    return loader.hf_dir_config(path), loader._hf_tokenizer_spec(path)  # noqa: SLF001


def load_model_meta(model: str) -> tuple[ModelConfig, TokenizerSpec]:
    """(ModelConfig, tokenizer spec or None for a byte tokenizer) of ``model``."""
    if model in DUMMY_CONFIGS:
        return DUMMY_CONFIGS[model], None
    if model == loader.DEFAULT_MODEL:
        model = loader.default_gguf_path()
    if model.endswith(".gguf") and os.path.isfile(model):
        return _gguf_meta(model)
    if os.path.isdir(model) and os.path.isfile(os.path.join(model, "config.json")):
        return _hf_meta(model)
    raise loader.ModelNotFoundError(f"unknown model {model!r}")


@dataclass
class PromptTokenizer:
    """Chat template + tokenization + model limits, as the router needs them."""

    tokenizer: Union[Tokenizer, ByteTokenizer]
    model_config: ModelConfig

    @property
    def context_length(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: Optional[list[dict]] = None,
                    template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
        """The chat template's tokens; ``add_special_tokens`` adds the tokenizer's own
        (BOS) on top of what the template wrote, as vLLM's /tokenize does;
        ``template_kwargs``: the request's further template variables. ``tools``
        (OpenAI's function objects) reach the model: as the template's ``tools`` when it
        renders them, else as a system text (tool_calls.py's ``tools_prompt``) after the
        first system message's content, or as a first system message; where the template
        refuses a system turn (Gemma 2's), as the start of the first user message."""
        template_tools = None
        if tools and "tools" in (self.tokenizer.chat_template or ""):
            template_tools = [{"type": "function", "function": fn} for fn in tools]
        elif tools:
            try:
                return self.encode_chat(with_tools_prompt(messages, tools),
                                        add_generation_prompt, add_special_tokens,
                                        template_kwargs=template_kwargs)
            except TemplateError:
                if not messages or messages[0]["role"] != "user":
                    raise  # the template refuses these messages, tools or not
                messages = with_tools_prompt(messages, tools, into="user")
        ids = list(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=template_tools,
            **(template_kwargs or {})))
        if add_special_tokens:  # what encoding "" adds is exactly the special prefix
            ids = self.encode_text("") + ids
        return ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's vocabulary entry (``Ġworld``, not `` world``)."""
        return [self.tokenizer.id_to_token(t) for t in token_ids]

    def out_of_vocab(self, token_ids: Sequence[int]) -> Optional[int]:
        """The first id outside ``[0, vocab_size)``, if any (``min``/``max`` first: a 16k
        prompt is checked in C, not in a Python loop)."""
        vocab = self.vocab_size
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab):
            return None
        return next(t for t in token_ids if not 0 <= t < vocab)


def with_tools_prompt(messages: list[dict[str, str]], tools: list[dict],
                      into: str = "system") -> list[dict[str, str]]:
    """``messages`` with the tools' system text merged into the first message if its role
    is ``into`` (before a user's words, after a system's), else in a new system message
    before them."""
    text = tools_prompt(tools)
    if messages and messages[0]["role"] == into:
        first = messages[0]
        parts = [text, first["content"]] if into == "user" else [first["content"], text]
        merged = "\n\n".join(p for p in parts if p)
        return [{**first, "content": merged}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def load_tokenizer(model: str) -> PromptTokenizer:
    """The tokenizer and limits of ``model`` (names as in ``ClusterConfig.model``); a model
    that cannot be served stops the start (``StartupError``, one line)."""
    try:
        config, spec = load_model_meta(model)
    except (loader.ModelNotFoundError, UnsupportedModelError) as exc:
        raise StartupError(f"model {model}: {exc}") from None
    tok = Tokenizer(spec) if spec is not None else ByteTokenizer(config.vocab_size)
    return PromptTokenizer(tokenizer=tok, model_config=config)
