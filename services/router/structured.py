"""Structured outputs: ``response_format`` and ``tool_choice`` become the one grammar
the workers sample under (SamplingParams.response_format; common/grammar.py
compiles it). A schema xgrammar cannot compile is refused here, before any work, with a
400 naming the field that carried it.

Tools (``ToolPlan``): a named function (``{"type": "function", "function": {"name":
...}}``): the answer is that function's arguments, a JSON document valid against its
``parameters`` (openai_format.py returns it as one call). ``"auto"`` (the default with
tools): an xgrammar structural tag lets the model write free text and, once it writes
``<tool_call>``, forces ``{"name": <a tool>, "arguments": <valid for it>}</tool_call>``;
``"required"``: only such calls, at least one. ``parallel_tool_calls: false`` ends the
answer after its first call. The router splits the answer into content and calls
(tool_calls.py, tool_response.py). ``"none"``: a text answer, the tools not shown.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from common.grammar import check_response_format
from services.router.errors import ApiError, invalid
from services.router.tool_calls import CALL_BEGIN, CALL_END, call_begin

MAX_SCHEMA_CHARS = 65_536  # a schema, as JSON text
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for schema and function names
JSON_OBJECT = '{"type":"json_object"}'
_NO_PARAMETERS = {"type": "object", "properties": {}}


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


def may_carry_grammar(body: Any) -> bool:
    """The body asks for a ``response_format`` or offers ``tools``: parsing it checks a
    grammar, so xgrammar must be loaded first (``common.grammar.xgrammar_loaded``)."""
    return isinstance(body, dict) and bool(body.get("response_format") or body.get("tools"))


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


def functions_of(tools: Any) -> dict[str, dict]:
    """The tools' functions by name (each checked: OpenAI's function tool shape)."""
    if not isinstance(tools, list):
        raise _bad("tools", "must be a list of function tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        ok = isinstance(fn, dict) and tool.get("type") == "function" and set(tool) == {
            "type", "function"} and isinstance(fn.get("name"), str) and \
            _NAME.fullmatch(fn["name"]) and not set(fn) - {
                "name", "description", "parameters", "strict"} and \
            isinstance(fn.get("parameters", {}), dict)
        if not ok or fn["name"] in out:
            raise _bad("tools", f"[{i}] must be {{\"type\": \"function\", \"function\": "
                       "{\"name\" (1-64 of A-Za-z0-9_-, unique), \"description\"?, "
                       "\"parameters\"? (an object), \"strict\"?}}")
        out[fn["name"]] = fn
    return out


@dataclass(frozen=True)
class ToolPlan:
    """What ``tools`` and ``tool_choice`` ask of the answer. ``named``: the function a
    named choice calls (the answer is its arguments); ``tagged``: ``"auto"`` or
    ``"required"`` (the answer is text with ``<tool_call>`` blocks, tool_calls.py splits
    it); ``functions``: the tools shown to the model in the prompt (none when it may not
    call one); ``grammar``: the response_format text the workers sample under."""

    grammar: Optional[str] = None
    named: Optional[str] = None
    tagged: bool = False
    functions: tuple[dict, ...] = ()


def _call_tag(name: str, parameters: Any) -> dict:
    return {"type": "tag", "begin": call_begin(name),
            "content": {"type": "json_schema", "json_schema": parameters},
            "end": "}" + CALL_END}


def tagged_format(functions: dict[str, dict], required: bool, parallel: bool) -> str:
    """The canonical response_format (an xgrammar structural tag, common/engine/
    grammar.py) of ``"auto"`` (free text; after ``<tool_call>`` one call of a tool,
    then free text again) or ``"required"`` (calls only, one per line, at least one);
    ``parallel`` false: the answer ends after the first call."""
    tags = [_call_tag(name, fn.get("parameters", _NO_PARAMETERS))
            for name, fn in functions.items()]
    fmt: dict = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags}
    if required:
        fmt = {"type": "tags_with_separator", "separator": "\n", "tags": tags,
               "at_least_one": True}
    fmt["stop_after_first"] = not parallel
    text = json.dumps({"type": "structural_tag", "format": fmt}, separators=(",", ":"))
    if len(text) > MAX_SCHEMA_CHARS:
        raise _bad("tools", f"have schemas over {MAX_SCHEMA_CHARS} characters of JSON")
    try:
        check_response_format(text)
    except ValueError as exc:
        raise _bad("tools", str(exc)) from exc
    return text


def _parallel(body: dict) -> bool:
    value = body.get("parallel_tool_calls")
    if value is None:
        return True
    if not isinstance(value, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls",
                      "invalid_type")
    return value


def _named(choice: Any) -> Optional[str]:
    """The function a named ``tool_choice`` names, None for any other value."""
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("function"), dict) and set(choice) == {"type", "function"} \
            and set(choice["function"]) == {"name"} and \
            isinstance(choice["function"]["name"], str):
        return choice["function"]["name"]
    return None


def tool_plan(body: dict) -> ToolPlan:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request."""
    functions = functions_of(body.get("tools") or [])
    parallel = _parallel(body)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none" or choice == "auto" and not functions:
        return ToolPlan()
    name = _named(choice)
    if name is None and not (isinstance(choice, str) and choice in ("auto", "required")):
        raise _bad("tool_choice", "must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if name is not None and name not in functions:
        raise _bad("tool_choice", f"names '{name}', which is not one of the tools")
    if not functions:
        raise _bad("tool_choice", "is \"required\" but there are no tools")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise invalid("'tool_choice' (a function call) cannot be combined with a JSON "
                      "response_format yet", "tool_choice", "unsupported_value")
    shown = tuple(functions.values())
    if name is not None:
        params = functions[name].get("parameters", _NO_PARAMETERS)
        return ToolPlan(schema_format(params, "tools"), named=name, functions=shown)
    return ToolPlan(tagged_format(functions, choice == "required", parallel), tagged=True,
                    functions=shown)
