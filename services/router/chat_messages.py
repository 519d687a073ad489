"""Chat ``messages`` as the model's chat template receives them; every key of a message
is honoured or refused (400 naming ``messages[i].<key>``), like the request's fields.

Honoured: ``role`` (``developer`` is OpenAI's newer name for ``system`` and becomes one),
``content`` (a string or text parts, joined) and ``name`` (passed to the template, as vLLM
and Hugging Face do; whether it shows in the prompt is the template's choice). An
assistant message's tool and audio keys are accepted only empty: tools are not built yet.
"""
from __future__ import annotations

from typing import Any

from services.router.errors import invalid
from services.router.request_fields import only

ROLES = ("system", "user", "assistant", "developer")
_ASSISTANT_EMPTY = {"tool_calls": [], "function_call": {}, "refusal": "", "audio": {}}
_NOT_EMPTY = "is only accepted empty: no tool calls, refusals or audio to replay yet"


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    param = f"messages[{index}].content"
    if not isinstance(content, list):
        raise invalid("message content must be a string or a list of text parts", param,
                      "invalid_type")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise invalid("only {\"type\": \"text\", \"text\": ...} parts are supported",
                          param, "invalid_type")
        extra = sorted(set(part) - {"type", "text"})
        if extra:
            key = f"{param}[{j}].{extra[0]}"
            raise invalid(f"unknown parameter '{key}'", key, "unknown_parameter")
        texts.append(part["text"])
    return "".join(texts)


def _check_keys(msg: dict, role: str, i: int) -> None:
    for key, value in msg.items():
        param = f"messages[{i}].{key}"
        if key in ("role", "content") or value is None:
            continue
        if key == "name":
            if not isinstance(value, str):
                raise invalid(f"'{param}' must be a string", param, "invalid_type")
        elif role == "assistant" and key in _ASSISTANT_EMPTY:
            only(_ASSISTANT_EMPTY[key], why=_NOT_EMPTY)(param, value)
        else:
            raise invalid(f"unknown parameter '{param}'", param, "unknown_parameter")


def parse_messages(value: Any) -> list[dict[str, str]]:
    """The messages for the chat template: ``{"role", "content"[, "name"]}``, strings."""
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", "messages", "invalid_value")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise invalid("each message must be an object", f"messages[{i}]",
                          "invalid_type")
        role = msg.get("role")
        if role in ("tool", "function"):
            raise invalid(f"{role} messages are not supported yet (no tools)",
                          f"messages[{i}].role", "invalid_value")
        if role not in ROLES:
            raise invalid(f"role must be one of {', '.join(ROLES)}, got {role!r}",
                          f"messages[{i}].role", "invalid_value")
        _check_keys(msg, role, i)
        if msg.get("content") is None:
            raise invalid("message content is required", f"messages[{i}].content",
                          "invalid_value")
        parsed = {"role": "system" if role == "developer" else role,
                  "content": _content_text(msg["content"], i)}
        if msg.get("name") is not None:
            parsed["name"] = msg["name"]
        out.append(parsed)
    return out
