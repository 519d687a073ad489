"""Tokenizers: a `tokenizers`-backed one with a jinja chat template, and a byte tokenizer
for dummy models. Both expose encode / decode / apply_chat_template."""
from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Optional

_BYTE_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """A chat template compiled once (compiling it per request was ~27 % of the router's
    time under load, measured with py-spy), in the environment transformers'
    ``apply_chat_template`` gives it, so a checkpoint's template renders the same text
    here: ``{% break %}``/``{% continue %}``, ``raise_exception``, ``strftime_now``, and
    a ``tojson`` that keeps key order and characters (jinja's own sorts the keys and
    escapes ``<>&'`` for HTML, which changes what Qwen's templates show of the tools)."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
               separators: Optional[tuple[str, str]] = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


def _render(template: str, messages: list[dict], add_generation_prompt: bool,
            tools: Optional[list[dict]] = None, **specials: Any) -> str:
    """``tools`` (OpenAI's tool objects) go to the template only when given, as
    Hugging Face's ``apply_chat_template`` passes them."""
    if tools is not None:
        specials["tools"] = tools
    return _compile(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **specials)


class Tokenizer:
    """A HF fast tokenizer (tokenizer.json) plus special tokens and chat template."""

    def __init__(self, spec: dict[str, Any]):
        from tokenizers import Tokenizer as _Tk

        self._tk = _Tk.from_str(spec["tokenizer_json"])
        self.chat_template: Optional[str] = spec.get("chat_template")
        self.bos_token: Optional[str] = spec.get("bos_token")
        self.eos_token: Optional[str] = spec.get("eos_token")
        self.add_bos_token = bool(spec.get("add_bos_token", False))
        self.bos_token_id = self._tk.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tk.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        return self._tk.id_to_token(token_id) or ""

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None, **extra: Any) -> str:
        """``extra``: the request's ``chat_template_kwargs`` (``enable_thinking``...)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        return _render(self.chat_template, messages, add_generation_prompt, tools,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                       **extra)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, **extra: Any) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt, tools, **extra),
                           add_special_tokens=False)


class ByteTokenizer:
    """Bytes as tokens (id = byte + 3); 0 pad, 1 bos, 2 eos. For dummy models."""

    OFFSET = 3

    def __init__(self, vocab_size: int, bos_token_id: int = 1, eos_token_id: int = 2):
        if vocab_size < 256 + self.OFFSET:
            raise ValueError(f"byte tokenizer needs vocab_size >= {256 + self.OFFSET}")
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = _BYTE_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return ([self.bos_token_id] + ids) if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        """A byte's token as sentencepiece names it (``<0x41>``), any other as ``<id>``."""
        if self.OFFSET <= token_id < 256 + self.OFFSET:
            return f"<0x{token_id - self.OFFSET:02X}>"
        return f"<{token_id}>"

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: Optional[list[dict]] = None, **extra: Any) -> str:
        return _render(self.chat_template, messages, add_generation_prompt, tools, **extra)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, **extra: Any) -> list[int]:
        ids = self.encode(self.render_chat(messages, add_generation_prompt, tools, **extra),
                          add_special_tokens=False)
        return [self.bos_token_id] + ids
