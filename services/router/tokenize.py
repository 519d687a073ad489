"""``POST /tokenize`` and ``POST /detokenize`` as vLLM defines them, with the router's
tokenizer: the very ids a generation request with the same prompt would be given.

/tokenize takes either a ``prompt`` (``add_special_tokens``, default true, as
/v1/completions encodes it) or chat ``messages`` (``add_generation_prompt``, default true,
as /v1/chat/completions renders them; ``add_special_tokens``, default false, adds the
tokenizer's BOS on top of the template's) and answers ``{"count", "max_model_len",
"tokens", "token_strs"}``; ``return_token_strs`` fills ``token_strs``. /detokenize takes
``tokens`` and answers ``{"prompt"}``. Chat ``tools`` are shown to the model as a chat
request with those tools and a ``tool_choice`` other than ``"none"`` shows them, so the
count is that request's prompt. As on the generation endpoints, a field is honoured or
refused with a 400 naming it; vLLM's template options that Crescent lacks
(``continue_final_message``, ``chat_template``, multimodal kwargs) are refused unless
off; ``chat_template_kwargs`` are honoured as on chat requests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from jinja2.exceptions import TemplateError

from services.router.chat_messages import parse_messages, parse_template_kwargs
from services.router.errors import invalid
from services.router.request_fields import boolean, only
from services.router.structured import functions_of
from services.router.tokenizer import PromptTokenizer
from services.router.validation import check_model

_OFF = {"continue_final_message": False, "chat_template": "", "media_io_kwargs": {},
        "mm_processor_kwargs": {}}


@dataclass(frozen=True)
class TokenizeRequest:
    """Exactly one of ``prompt`` and ``messages``."""

    prompt: Optional[str] = None
    messages: Optional[list[dict[str, str]]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: tuple[dict, ...] = ()  # chat: the functions shown to the model
    template_kwargs: Optional[dict[str, Any]] = None  # chat: chat_template_kwargs

    @property
    def size(self) -> int:
        """Characters to tokenize (long texts are tokenized off the event loop)."""
        if self.prompt is not None:
            return len(self.prompt)
        return sum(len(m["content"]) for m in self.messages or [])


def _check_keys(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or value is None:
            continue
        if name not in _OFF:
            raise invalid(f"unknown parameter '{name}'", name, "unknown_parameter")
        only(_OFF[name], why="is not supported: Crescent renders the model's own chat "
             "template only")(name, value)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    boolean(name, value)
    return value


def parse_tokenize(body: Any, served: Sequence[str]) -> TokenizeRequest:
    """Validate a /tokenize body (vLLM's TokenizeCompletionRequest or ...ChatRequest)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_model(body, served)
    chat = body.get("messages") is not None
    if chat == (body.get("prompt") is not None):
        raise invalid("give exactly one of 'prompt' and 'messages'",
                      "messages" if chat else "prompt", "invalid_value")
    flags = {"model", "return_token_strs", "add_special_tokens"}
    if not chat:
        _check_keys(body, flags | {"prompt"})
        if not isinstance(body["prompt"], str):
            raise invalid("'prompt' must be a string", "prompt", "invalid_type")
        return TokenizeRequest(prompt=body["prompt"],
                               add_special_tokens=_flag(body, "add_special_tokens", True),
                               return_token_strs=_flag(body, "return_token_strs", False))
    _check_keys(body, flags | {"messages", "add_generation_prompt", "tools",
                               "chat_template_kwargs"})
    return TokenizeRequest(
        messages=parse_messages(body["messages"]),
        template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")),
        tools=tuple(functions_of(body.get("tools") or []).values()),
        add_special_tokens=_flag(body, "add_special_tokens", False),
        add_generation_prompt=_flag(body, "add_generation_prompt", True),
        return_token_strs=_flag(body, "return_token_strs", False))


def tokenize(tok: PromptTokenizer, req: TokenizeRequest) -> dict:
    """The /tokenize answer."""
    if req.messages is not None:
        ids = encode_chat(tok, req.messages, req.add_generation_prompt,
                          req.add_special_tokens, list(req.tools) or None, req.template_kwargs)
    else:
        ids = tok.encode_text(req.prompt or "", req.add_special_tokens)
    return {"count": len(ids), "max_model_len": tok.context_length, "tokens": ids,
            "token_strs": tok.token_strs(ids) if req.return_token_strs else None}


def parse_detokenize(body: Any, tok: PromptTokenizer, served: Sequence[str]) -> list[int]:
    """The token ids of a /detokenize body, each checked against the vocabulary."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    check_model(body, served)
    _check_keys(body, {"model", "tokens"})
    ids = body.get("tokens")
    if ids is None:
        raise invalid("'tokens' is required", "tokens", "missing_required_parameter")
    if not isinstance(ids, list) or \
            not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid("'tokens' must be a list of token ids", "tokens", "invalid_type")
    check_token_ids(tok, ids, "tokens")
    return ids


def encode_chat(tok: PromptTokenizer, messages: list[dict[str, str]],
                add_generation_prompt: bool = True, add_special_tokens: bool = False,
                tools: Optional[list[dict]] = None,
                template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """The chat template's tokens (with ``tools`` shown to the model and the request's
    ``template_kwargs``); a 400 when the model's template refuses the messages."""
    try:
        return tok.encode_chat(messages, add_generation_prompt, add_special_tokens, tools,
                               template_kwargs)
    except TemplateError as exc:
        raise invalid(f"chat template: {exc}", "messages", "invalid_value") from None


def check_token_ids(tok: PromptTokenizer, ids: list[int], param: str) -> None:
    bad = tok.out_of_vocab(ids)
    if bad is not None:
        raise invalid(f"token id {bad} is outside the vocabulary [0, {tok.vocab_size})",
                      param, "invalid_value")
