"""Which request fields the router honours, which it takes only at values that change
nothing, and the 400 for everything else: no field is ever silently ignored.

A field that changes the output (``tools``, ``response_format``, ``n: 2``) is either
honoured or refused with a 400 whose ``param`` names it, since a request
answered without it looks right and is wrong. Fields the router parses and honours are
listed in ``PARSED`` (validation.py parses them); the rest are in ``LIMITED`` with the
check that accepts their harmless values (``store: false``, ``functions: []``,
``suffix: ""``...) and refuses the others. A field in neither is refused as unknown:
the official ``openai`` client never sends a field the caller did not set, so a strict
server costs its users nothing, while vLLM's choice (ignore unknown fields with a log
line) lets a typo such as ``max_token`` pass unnoticed.
"""
from __future__ import annotations

from typing import Any, Callable

from services.router.errors import ApiError, invalid

CHAT, COMPLETION = "chat", "completion"
ENDPOINT = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}

_SHARED = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
           "stop", "n", "stream", "stream_options", "logprobs",
           "frequency_penalty", "presence_penalty", "logit_bias",
           "top_k", "ignore_eos", "stop_token_ids"}  # the last three: vLLM's extensions
PARSED = {CHAT: _SHARED | {"messages", "top_logprobs", "response_format", "tools",
                          "tool_choice", "parallel_tool_calls",  # these 4: structured.py
                          "chat_template_kwargs"},  # vLLM's, chat_messages.py
          COMPLETION: _SHARED | {"prompt", "best_of", "echo"}}

Check = Callable[[str, Any], None]  # raises ApiError (400) naming the field


def unsupported(name: str, why: str) -> ApiError:
    return invalid(f"'{name}' {why}", name, "unsupported_value")


def _same(a: Any, b: Any) -> bool:
    """JSON equality that tells true from 1 and 0 from false."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def only(*allowed: Any, why: str) -> Check:
    """Accept exactly ``allowed`` (the values that ask for what Crescent does anyway)."""
    def check(name: str, value: Any) -> None:
        if not any(_same(value, a) for a in allowed):
            raise unsupported(name, why)
    return check


def refused(why: str) -> Check:
    def check(name: str, value: Any) -> None:
        raise invalid(f"'{name}' {why}", name, "unsupported_parameter")
    return check


def text(name: str, value: Any) -> None:
    """An identifier that changes no output (``user``, ``safety_identifier``)."""
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a string", name, "invalid_type")


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean", name, "invalid_type")


def metadata(name: str, value: Any) -> None:
    """OpenAI's shape: at most 16 string pairs, keys <= 64 and values <= 512 characters."""
    ok = isinstance(value, dict) and len(value) <= 16 and all(
        isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items())
    if not ok:
        raise invalid(f"'{name}' must be an object of at most 16 string values (keys up "
                      "to 64 characters, values up to 512)", name, "invalid_value")


_NO_TOOLS = "is deprecated and not supported: use 'tools' (null or [] accepted)"
_NO_CHOICE = "is deprecated and not supported: use 'tool_choice' (\"none\", \"auto\" accepted)"
_ONE_TIER = "must be \"auto\" or \"default\": Crescent has one service tier"

LIMITED: dict[str, tuple[tuple[str, ...], Check]] = {
    # Identifiers and bookkeeping: accepted, they change no output.
    "user": ((CHAT, COMPLETION), text),
    "safety_identifier": ((CHAT,), text),
    "prompt_cache_key": ((CHAT,), text),  # every prefix is cached whatever the key
    "metadata": ((CHAT,), metadata),
    "store": ((CHAT,), only(False, why="must be false: Crescent stores no completions")),
    "service_tier": ((CHAT,), only("auto", "default", why=_ONE_TIER)),
    "prompt_cache_retention": ((CHAT,), only("in_memory", why="must be \"in_memory\": "
                                             "cached prefixes live as long as memory "
                                             "allows, never a promised 24 h")),
    "modalities": ((CHAT,), only(["text"], why="must be [\"text\"]: text output only")),
    # Output-changing features not built yet: only their "off" values.
    "functions": ((CHAT,), only([], why=_NO_TOOLS)),
    "function_call": ((CHAT,), only("none", "auto", why=_NO_CHOICE)),
    "suffix": ((COMPLETION,), only("", why="is not supported yet: only \"\"")),
    # Features of other models or of OpenAI's platform.
    "audio": ((CHAT,), refused("is not supported: text output only")),
    "prediction": ((CHAT,), refused("is not supported (no predicted outputs)")),
    "reasoning_effort": ((CHAT,), refused("is not supported: the model does not reason")),
    "verbosity": ((CHAT,), refused("is not supported")),
    "web_search_options": ((CHAT,), refused("is not supported: no web search")),
    "moderation": ((CHAT,), refused("is not supported: no moderation")),
    "prompt_cache_options": ((CHAT,), refused("is not supported: no explicit cache "
                                              "breakpoints (every prefix is cached)")),
}


def check_fields(body: dict, kind: str) -> None:
    """Refuse every field of ``body`` that ``kind``'s endpoint does not honour; ``null``
    counts as absent. Parsed fields are left to validation.py."""
    for name, value in body.items():
        if name in PARSED[kind] or value is None:
            continue
        kinds, check = LIMITED.get(name, ((), None))
        if check is not None and kind in kinds:
            check(name, value)
            continue
        other = COMPLETION if kind == CHAT else CHAT
        where = "no such field (docs/api.md lists them)"
        if name in PARSED[other] or other in kinds:
            where = f"a {ENDPOINT[other]} field, not one of {ENDPOINT[kind]}"
        raise invalid(f"unknown parameter '{name}': {where}", name, "unknown_parameter")
