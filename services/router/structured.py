"""Structured outputs: ``response_format`` and a named ``tool_choice`` become the one
grammar the workers sample under (SamplingParams.response_format; common/engine/
grammar.py compiles it). A schema xgrammar cannot compile is refused here, before any
work, with a 400 naming the field that carried it.

Tools: only a named function (``tool_choice: {"type": "function", "function": {"name":
...}}``) is honoured: the answer is that function's arguments, a JSON document valid
against its ``parameters``, returned in OpenAI's ``tool_calls`` shape (openai_format.py).
``tool_choice: "none"`` answers in text. ``"auto"`` (the default with tools) and
``"required"`` would need the model to choose between text and tools, which a grammar
alone does not decide: they are refused with a 400 naming ``tool_choice``.
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional

from common.engine.grammar import check_response_format
from services.router.errors import ApiError, invalid

MAX_SCHEMA_CHARS = 65_536  # a schema, as JSON text
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for schema and function names
JSON_OBJECT = '{"type":"json_object"}'


def _bad(param: str, why: str) -> ApiError:
    return invalid(f"'{param}' {why}", param, "invalid_value")


def schema_format(schema: Any, param: str) -> str:
    """The canonical response_format text for ``schema``, checked to compile. Only the
    schema shapes the grammar, so equal schemas share one compiled grammar on every
    worker; key order is kept (properties come out in it)."""
    if not isinstance(schema, dict):
        raise _bad(param, "needs a JSON schema object")
    text = json.dumps({"type": "json_schema", "json_schema": {"schema": schema}},
                      separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise _bad(param, f"has a schema over {MAX_SCHEMA_CHARS} characters of JSON")
    try:
        check_response_format(text)
    except ValueError as exc:
        raise _bad(param, str(exc)) from exc
    return text


def response_format(body: dict) -> Optional[str]:
    """OpenAI's ``response_format`` (None for ``text``)."""
    fmt = body.get("response_format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text" and len(fmt) == 1):
        return None
    param = "response_format"
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise _bad(param, "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")
    if fmt["type"] == "json_object":
        if len(fmt) != 1:
            raise _bad(param, "of type json_object takes no other key")
        return JSON_OBJECT
    spec = fmt.get("json_schema")
    if len(fmt) != 2 or not isinstance(spec, dict):
        raise _bad(param, "of type json_schema needs a 'json_schema' object (and no other key)")
    if not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
        raise _bad(param, "json_schema.name must be 1-64 letters, digits, '_' or '-'")
    if set(spec) - {"name", "description", "schema", "strict"} or \
            not isinstance(spec.get("strict", False), (bool, type(None))):
        raise _bad(param, "json_schema takes name, description, schema (an object), "
                          "strict (bool)")
    return schema_format(spec.get("schema", {}), param)


def _functions(tools: Any) -> dict[str, dict]:
    """The tools' functions by name (each checked: OpenAI's function tool shape)."""
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of function tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        ok = isinstance(fn, dict) and tool.get("type") == "function" and set(tool) == {
            "type", "function"} and isinstance(fn.get("name"), str) and \
            _NAME.fullmatch(fn["name"]) and not set(fn) - {
                "name", "description", "parameters", "strict"}
        if not ok or fn["name"] in out:
            raise _bad("tools", f"[{i}] must be {{\"type\": \"function\", \"function\": "
                       "{\"name\" (1-64 of A-Za-z0-9_-, unique), \"description\"?, "
                       "\"parameters\"?, \"strict\"?}}")
        out[fn["name"]] = fn
    return out


def tool_call(body: dict) -> tuple[Optional[str], Optional[str]]:
    """(the function the answer calls, the grammar of its arguments), or (None, None)
    for a text answer."""
    functions = _functions(body.get("tools") or [])
    choice = body.get("tool_choice")
    if choice in (None, "none", "auto") and not functions or choice == "none":
        return None, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
        else None
    if name is None:
        raise invalid("'tool_choice' with tools must be \"none\" or a named function "
                      "({\"type\": \"function\", \"function\": {\"name\": ...}}): \"auto\" "
                      "and \"required\" are not supported yet", "tool_choice",
                      "unsupported_value")
    if name not in functions:
        raise _bad("tool_choice", f"names '{name}', which is not one of the tools")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise _bad("tool_choice", "cannot name a function together with a JSON "
                   "response_format")
    params = functions[name].get("parameters", {"type": "object", "properties": {}})
    return name, schema_format(params, "tools")
