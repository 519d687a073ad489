"""Chat ``messages`` as the model's chat template receives them; every key of a message
is honoured or refused (400 naming ``messages[i].<key>``), like the request's fields.

Honoured: ``role`` (``developer`` is OpenAI's newer name for ``system`` and becomes one),
``content`` (a string or text parts, joined), ``name`` and an assistant's
``reasoning_content`` (a thinking model's earlier reasoning, as a reasoning parser returned
it) (passed to the template, as vLLM and Hugging Face do; whether they show in the prompt
is the template's choice: Qwen 3's shows the reasoning of the turns after the last user
message).

Tool history: an assistant message's ``tool_calls`` (``[{"id", "type": "function",
"function": {"name", "arguments"}}]``; its content may then be null) are rendered into its
content as the model writes calls (``<tool_call>{"name": ..., "arguments": ...}
</tool_call>``, one per line after the text; tool_calls.py), and a ``tool`` message
(``tool_call_id``, ``content``: the call's result) stays a ``tool`` message for the
template, with its ``tool_call_id``; its id must be one of an earlier assistant call's.
The deprecated ``function`` role, ``function_call``, ``refusal`` and ``audio`` are accepted
only empty.

``chat_template_kwargs`` (vLLM's and SGLang's field: Qwen 3's ``{"enable_thinking":
false}``) are further variables for the template, as transformers' ``apply_chat_template``
takes them; the names the renderer binds itself are refused.
"""
from __future__ import annotations

import json
import re
from typing import Any

from services.router.errors import invalid
from services.router.request_fields import only
from services.router.tool_calls import call_text

ROLES = ("system", "user", "assistant", "developer", "tool")
# what the renderer binds (common/model/tokenizer.py): a request may not set them
TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                  "raise_exception", "strftime_now")
MAX_TEMPLATE_KWARGS = 32
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ASSISTANT_EMPTY = {"function_call": {}, "refusal": "", "audio": {}}
_NOT_EMPTY = "is only accepted empty: no function calls, refusals or audio to replay"
_CALL = "must be {\"id\": str, \"type\": \"function\", \"function\": {\"name\": str, " \
    "\"arguments\": str}}"


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
        if key == "name" or role == "assistant" and key == "reasoning_content":
            if not isinstance(value, str):
                raise invalid(f"'{param}' must be a string", param, "invalid_type")
        elif role == "assistant" and key in _ASSISTANT_EMPTY:
            only(_ASSISTANT_EMPTY[key], why=_NOT_EMPTY)(param, value)
        elif not (role == "assistant" and key == "tool_calls" or
                  role == "tool" and key == "tool_call_id"):
            raise invalid(f"unknown parameter '{param}'", param, "unknown_parameter")


def _arguments_json(arguments: str) -> str:
    """The arguments as JSON text in the call: as sent when they parse (the model's own
    text round-trips), else as a JSON string."""
    try:
        json.loads(arguments)
        return arguments
    except ValueError:
        return json.dumps(arguments)


def _calls(value: Any, i: int) -> list[tuple[str, str]]:
    """An assistant message's ``tool_calls``: (id, the call's text) each."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be a list of tool calls", param, "invalid_type")
    out = []
    for j, call in enumerate(value):
        here = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        ok = isinstance(fn, dict) and isinstance(call.get("id"), str) and \
            call.get("type") == "function" and isinstance(fn.get("name"), str) and \
            isinstance(fn.get("arguments"), str)
        if not ok:
            raise invalid(f"'{here}' {_CALL}", here, "invalid_value")
        for key, keys in ((here, set(call) - {"id", "type", "function"}),
                          (f"{here}.function", set(fn) - {"name", "arguments"})):
            if keys:
                bad = f"{key}.{sorted(keys)[0]}"
                raise invalid(f"unknown parameter '{bad}'", bad, "unknown_parameter")
        out.append((call["id"], call_text(fn["name"], _arguments_json(fn["arguments"]))))
    return out


def _content(msg: dict, i: int, calls: list[tuple[str, str]]) -> str:
    if msg.get("content") is None and not calls:
        raise invalid("message content is required", f"messages[{i}].content",
                      "invalid_value")
    text = _content_text(msg["content"], i) if msg.get("content") is not None else ""
    return "\n".join([text] * bool(text) + [call for _, call in calls])


def _tool_call_id(msg: dict, i: int, call_ids: set[str]) -> str:
    param = f"messages[{i}].tool_call_id"
    value = msg.get("tool_call_id")
    if value is None:
        raise invalid("a tool message needs the 'tool_call_id' of the call it answers",
                      param, "missing_required_parameter")
    if not isinstance(value, str):
        raise invalid(f"'{param}' must be a string", param, "invalid_type")
    if value not in call_ids:
        raise invalid(f"'{param}' {value!r} is not the id of an earlier assistant tool "
                      "call", param, "invalid_value")
    return value


def parse_template_kwargs(value: Any, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """``chat_template_kwargs``: at most 32 variables named as in a template, JSON values,
    none of the renderer's own (``TEMPLATE_NAMES``); null is none."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_TEMPLATE_KWARGS:
        raise invalid(f"'{param}' must be an object of at most {MAX_TEMPLATE_KWARGS} "
                      "template variables", param, "invalid_type")
    for name in value:
        if not _NAME.match(name):
            raise invalid(f"'{param}' names a variable {name!r} that is not an identifier",
                          f"{param}.{name}", "invalid_value")
        if name in TEMPLATE_NAMES:
            raise invalid(f"'{param}' may not set {name!r}: the server renders it",
                          f"{param}.{name}", "invalid_value")
    return dict(value)


def parse_messages(value: Any) -> list[dict[str, str]]:
    """The messages for the chat template: ``{"role", "content"[, "name"][,
    "tool_call_id"]}``, strings."""
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list", "messages", "invalid_value")
    out = []
    call_ids: set[str] = set()
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise invalid("each message must be an object", f"messages[{i}]",
                          "invalid_type")
        role = msg.get("role")
        if role == "function":
            raise invalid("function messages (deprecated) are not supported: use tool "
                          "messages", f"messages[{i}].role", "invalid_value")
        if role not in ROLES:
            raise invalid(f"role must be one of {', '.join(ROLES)}, got {role!r}",
                          f"messages[{i}].role", "invalid_value")
        _check_keys(msg, role, i)
        calls = _calls(msg["tool_calls"], i) if role == "assistant" and \
            msg.get("tool_calls") is not None else []
        parsed = {"role": "system" if role == "developer" else role,
                  "content": _content(msg, i, calls)}
        call_ids.update(call_id for call_id, _ in calls)
        if role == "tool":
            parsed["tool_call_id"] = _tool_call_id(msg, i, call_ids)
        for key in ("name", "reasoning_content"):  # the template's to show or not
            if msg.get(key) is not None:
                parsed[key] = msg[key]
        out.append(parsed)
    return out
