"""Every field of the chat and completions requests is honoured or refused with a 400 that
names it: never accepted and ignored.

The table below is written by hand from the OpenAI API reference (and vLLM's extensions
Crescent takes); each row is a field, an example value and the verdict. An honoured row
also says what it must change in the parsed request, so "accepted" cannot pass for
"honoured". The table is checked for completeness against the installed ``openai``
client's own request types and against the router's field policy.
"""
from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from common.sampling_params import SamplingParams
from services.router.errors import ApiError
from services.router.request_fields import LIMITED, PARSED
from services.router.validation import GenerationRequest, parse_request

MODEL = "smollm2-135m"
DEFAULT_MAX = 7
BASE = {"chat": {"messages": [{"role": "user", "content": "hi"}]},
        "completion": {"prompt": "hi"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted (changes nothing)", "refused"
Effect = Callable[[GenerationRequest], bool]
DEFAULT = SamplingParams(max_tokens=DEFAULT_MAX)


@dataclass(frozen=True)
class Row:
    kinds: str  # "chat", "completion" or "both"
    field: str
    value: Any
    verdict: str
    effect: Optional[Effect] = None  # HONOURED: what the field must change

    def applies(self, kind: str) -> bool:
        return self.kinds in (kind, "both")


def _sampling(**changes: Any) -> Effect:
    return lambda req: req.sampling == SamplingParams(**{"max_tokens": DEFAULT_MAX,
                                                         **changes})


ROWS = [
    Row("chat", "messages", [{"role": "system", "content": "s"},
                             {"role": "user", "content": [{"type": "text", "text": "q"}]}],
        HONOURED, lambda r: r.messages == [{"role": "system", "content": "s"},
                                           {"role": "user", "content": "q"}]),
    Row("completion", "prompt", [1, 2, 3], HONOURED, lambda r: r.prompt == [1, 2, 3]),
    Row("completion", "prompt", ["a", "b"], HONOURED, lambda r: r.prompts == ["a", "b"]),
    Row("completion", "prompt", [[1], [2, 3]], HONOURED,
        lambda r: r.prompts == [[1], [2, 3]]),
    Row("both", "model", MODEL, HONOURED, lambda r: r.model == MODEL),
    Row("both", "model", "gpt-4o", REFUSED),
    Row("both", "max_tokens", 5, HONOURED, _sampling(max_tokens=5)),
    Row("both", "max_completion_tokens", 6, HONOURED, _sampling(max_tokens=6)),
    Row("both", "temperature", 0.5, HONOURED, _sampling(temperature=0.5)),
    Row("both", "top_p", 0.9, HONOURED, _sampling(top_p=0.9)),
    Row("both", "seed", 11, HONOURED, _sampling(seed=11)),
    Row("both", "stop", ["\n\n"], HONOURED, _sampling(stop=("\n\n",))),
    Row("both", "stream", True, HONOURED, lambda r: r.stream),
    Row("both", "n", 1, HONOURED, _sampling()),
    Row("both", "n", 3, HONOURED, lambda r: r.returned == 3 and r.sampling == SamplingParams(
        max_tokens=DEFAULT_MAX, n=3)),
    Row("both", "n", 17, REFUSED),
    Row("chat", "logprobs", True, HONOURED, _sampling(logprobs=True)),
    Row("completion", "logprobs", 0, HONOURED, _sampling(logprobs=True)),
    Row("completion", "logprobs", 3, HONOURED, _sampling(logprobs=True, top_logprobs=3)),
    Row("completion", "logprobs", 6, REFUSED),
    Row("chat", "top_logprobs", 0, ACCEPTED),
    Row("chat", "top_logprobs", 2, REFUSED),  # without 'logprobs': true
    Row("both", "top_k", 4, HONOURED, _sampling(top_k=4)),
    Row("both", "ignore_eos", True, HONOURED, _sampling(ignore_eos=True)),
    Row("both", "stop_token_ids", [7, 9], HONOURED, _sampling(stop_token_ids=(7, 9))),
    Row("chat", "chat_template_kwargs", {"enable_thinking": False}, HONOURED,
        lambda r: r.template_kwargs == {"enable_thinking": False}),
    Row("chat", "chat_template_kwargs", "enable_thinking", REFUSED),
    Row("both", "frequency_penalty", 0.5, HONOURED, _sampling(frequency_penalty=0.5)),
    Row("both", "frequency_penalty", 2.5, REFUSED),
    Row("both", "presence_penalty", -1, HONOURED, _sampling(presence_penalty=-1.0)),
    Row("both", "presence_penalty", "1", REFUSED),
    Row("both", "logit_bias", {"12": -100, "7": 2.5}, HONOURED, _sampling(
        logit_bias_ids=(12, 7), logit_bias_values=(-100.0, 2.5))),
    Row("both", "logit_bias", {"12": 101}, REFUSED),
    Row("both", "logit_bias", {"x": 1}, REFUSED),
    Row("both", "user", "user-1", ACCEPTED),
    Row("chat", "safety_identifier", "hash-1", ACCEPTED),
    Row("chat", "prompt_cache_key", "tenant-1", ACCEPTED),
    Row("chat", "metadata", {"team": "a"}, ACCEPTED),
    Row("chat", "metadata", {"k": 1}, REFUSED),
    Row("chat", "store", False, ACCEPTED),
    Row("chat", "store", True, REFUSED),
    Row("chat", "service_tier", "auto", ACCEPTED),
    Row("chat", "service_tier", "flex", REFUSED),
    Row("chat", "prompt_cache_retention", "in_memory", ACCEPTED),
    Row("chat", "prompt_cache_retention", "24h", REFUSED),
    Row("chat", "prompt_cache_options", {"mode": "explicit"}, REFUSED),
    Row("chat", "modalities", ["text"], ACCEPTED),
    Row("chat", "modalities", ["text", "audio"], REFUSED),
    Row("chat", "audio", {"voice": "alloy", "format": "wav"}, REFUSED),
    Row("chat", "response_format", {"type": "text"}, HONOURED, _sampling()),
    Row("chat", "response_format", {"type": "json_object"}, HONOURED,
        _sampling(response_format='{"type":"json_object"}')),
    Row("chat", "response_format", SCHEMA, HONOURED, _sampling(
        response_format='{"type":"json_schema","json_schema":{"schema":{"type":"object"}}}')),
    Row("chat", "response_format", {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}},
        REFUSED),  # a schema xgrammar cannot compile
    Row("chat", "response_format", {"type": "json_schema", "json_schema": {
        "name": "no spaces", "schema": {"type": "object"}}}, REFUSED),
    Row("chat", "response_format", {"type": "yaml"}, REFUSED),
    Row("chat", "tools", [], ACCEPTED),
    Row("chat", "tools", [{"type": "function"}], REFUSED),
    Row("chat", "tools", [TOOL, TOOL], REFUSED),  # two functions of one name
    Row("chat", "tool_choice", "none", ACCEPTED),
    Row("chat", "tool_choice", "auto", ACCEPTED),
    Row("chat", "tool_choice", "required", REFUSED),  # no tools to call
    Row("chat", "tool_choice", {"type": "function", "function": {"name": "f"}}, REFUSED),
    Row("chat", "tool_choice", "sometimes", REFUSED),
    Row("chat", "parallel_tool_calls", False, ACCEPTED),  # no tools: changes nothing
    Row("chat", "parallel_tool_calls", "no", REFUSED),
    Row("chat", "functions", [TOOL["function"]], REFUSED),
    Row("chat", "function_call", "none", ACCEPTED),
    Row("chat", "function_call", {"name": "f"}, REFUSED),
    Row("chat", "prediction", {"type": "content", "content": "x"}, REFUSED),
    Row("chat", "reasoning_effort", "low", REFUSED),
    Row("chat", "verbosity", "low", REFUSED),
    Row("chat", "web_search_options", {}, REFUSED),
    Row("chat", "moderation", {"input": True}, REFUSED),
    Row("completion", "best_of", 3, HONOURED, lambda r: r.returned == 1 and r.sampling ==
        SamplingParams(max_tokens=DEFAULT_MAX, n=3)),
    Row("completion", "best_of", 0, REFUSED),  # below n
    Row("completion", "echo", False, ACCEPTED),
    Row("completion", "echo", True, HONOURED, lambda r: r.echo and r.sampling == DEFAULT),
    Row("both", "max_tokens", 0, REFUSED),  # 0 only with echo: test_echo_and_batches.py
    Row("completion", "suffix", "", ACCEPTED),
    Row("completion", "suffix", "tail", REFUSED),
    Row("both", "min_p", 0.1, REFUSED),  # a vLLM extension Crescent does not have
    Row("both", "max_token", 5, REFUSED),  # a typo
]
STREAM_ROWS = [  # inside stream_options (with "stream": true)
    Row("both", "include_usage", True, HONOURED, lambda r: r.include_usage),
    Row("both", "include_obfuscation", False, ACCEPTED),
    Row("both", "include_obfuscation", True, REFUSED),
    Row("both", "continuous_usage_stats", True, REFUSED),
]


def parse(kind: str, extra: dict) -> GenerationRequest:
    return parse_request({**BASE[kind], **extra}, kind, (MODEL,), DEFAULT_MAX)


def check_row(kind: str, body: dict, row: Row, param: str, baseline: dict) -> None:
    if row.verdict == REFUSED:
        with pytest.raises(ApiError) as info:
            parse(kind, body)
        err = info.value.body()["error"]
        assert (info.value.status, err["type"], err["param"]) == \
            (400, "invalid_request_error", param), err
        assert param in err["message"], err
        return
    req = parse(kind, body)
    if row.verdict == HONOURED:
        assert row.effect is not None and row.effect(req), (row, req)
    else:  # accepted: the request is exactly as if the field were absent
        assert req == parse(kind, baseline), (row, req)


def _case_id(row: Row) -> str:
    return f"{row.field}={row.value!r}"[:60]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("row", ROWS, ids=_case_id)
def test_field(kind: str, row: Row) -> None:
    if not row.applies(kind):
        return
    check_row(kind, {row.field: row.value}, row, row.field, {})


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("row", STREAM_ROWS, ids=_case_id)
def test_stream_option(kind: str, row: Row) -> None:
    body = {"stream": True, "stream_options": {row.field: row.value}}
    check_row(kind, body, row, f"stream_options.{row.field}", {"stream": True})


def test_named_tool_choice_is_a_grammar_over_its_parameters() -> None:
    named = {"type": "function", "function": {"name": "f"}}
    req = parse("chat", {"tools": [TOOL], "tool_choice": named})
    assert req.tool_call == "f" and req.sampling == SamplingParams(
        DEFAULT_MAX, response_format='{"type":"json_schema","json_schema":{"schema":'
                                     '{"type":"object"}}}')
    assert req.tools == [TOOL["function"]] and not req.tagged_calls
    assert parse("chat", {"tools": [TOOL], "tool_choice": "none"}) == parse("chat", {})
    for body, param in (({"tools": [TOOL], "tool_choice": {"type": "function", "function":
                                                           {"name": "g"}}}, "tool_choice"),
                        ({"tools": [TOOL], "tool_choice": named,
                          "response_format": {"type": "json_object"}}, "tool_choice"),
                        ({"tools": [TOOL], "response_format": {"type": "json_object"}},
                         "tool_choice"),  # "auto" by default
                        ({"tools": [{"type": "function", "function": {
                            "name": "f", "parameters": {"type": "nope"}}}],
                          "tool_choice": named}, "tools"),
                        ({"tools": [{"type": "function", "function": {
                            "name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
                        ({"tools": [{"type": "function", "function": {
                            "name": "f", "parameters": []}}]}, "tools")):
        with pytest.raises(ApiError) as info:
            parse("chat", body)
        assert info.value.param == param, (body, info.value.message)


G = {"type": "function", "function": {"name": "g"}}  # no parameters: an empty object


def _tag(name: str, params: dict) -> dict:
    return {"type": "tag", "begin": f'<tool_call>{{"name": "{name}", "arguments": ',
            "content": {"type": "json_schema", "json_schema": params}, "end": "}</tool_call>"}


@pytest.mark.parametrize("choice", [None, "auto", "required"])
@pytest.mark.parametrize("parallel", [None, True, False])
def test_auto_and_required_are_structural_tags(choice: Optional[str],
                                               parallel: Optional[bool]) -> None:
    """"auto" (the default with tools): free text, and a call's JSON forced once it
    starts; "required": calls only, at least one; parallel_tool_calls false: one."""
    req = parse("chat", {"tools": [TOOL, G], "tool_choice": choice,
                         "parallel_tool_calls": parallel})
    tags = [_tag("f", {"type": "object"}), _tag("g", {"type": "object", "properties": {}})]
    fmt: dict = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags}
    if choice == "required":
        fmt = {"type": "tags_with_separator", "separator": "\n", "tags": tags,
               "at_least_one": True}
    fmt["stop_after_first"] = parallel is False
    assert json.loads(req.sampling.response_format) == {"type": "structural_tag",
                                                         "format": fmt}
    assert req.tagged_calls and req.tool_call is None
    assert req.tools == [TOOL["function"], G["function"]]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_null_is_absent(kind: str) -> None:
    """The openai client sends only what its caller set; null for a field means unset."""
    fields = {row.field for row in ROWS if row.applies(kind)} - set(BASE[kind])
    assert parse(kind, {name: None for name in fields}) == parse(kind, {})


@pytest.mark.parametrize("kind, field", [("chat", "echo"), ("chat", "prompt"),
                                         ("completion", "messages"),
                                         ("completion", "tools")])
def test_other_endpoints_field_is_named(kind: str, field: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(kind, {field: "x"})
    assert info.value.param == field and info.value.code == "unknown_parameter"
    assert "not one of" in info.value.message


def _openai_fields(module: Any) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_table_covers_every_openai_field(kind: str) -> None:
    """Every field the installed ``openai`` client can send has a verdict in the table
    (a new client version with a new field fails here until it is classified)."""
    openai_types = pytest.importorskip("openai.types")
    module = openai_types.chat.completion_create_params if kind == "chat" \
        else openai_types.completion_create_params
    tabled = {row.field for row in ROWS if row.applies(kind)} | {"stream_options"}
    assert _openai_fields(module) - tabled == set()


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_table_covers_the_router_policy(kind: str) -> None:
    """Every field the router takes is in the table, tested above, and in docs/api.md."""
    tabled = {row.field for row in ROWS if row.applies(kind)} | {"stream_options"}
    taken = PARSED[kind] | {name for name, (kinds, _) in LIMITED.items() if kind in kinds}
    assert taken - tabled == set()
    docs = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    assert {name for name in taken if f"`{name}`" not in docs} == set()


def test_what_the_openai_client_sends_is_accepted() -> None:
    """The client sends only what its caller set (no defaults, no nulls), so the strict
    policy refuses nothing it sends unasked; captured with a mock transport."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    sent: list[dict] = []

    def capture(request: Any) -> Any:
        sent.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "captured"}})

    client = openai.OpenAI(base_url="http://crescent.invalid/v1", api_key="k", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(capture)))
    chat, messages = client.chat.completions, BASE["chat"]["messages"]
    calls = [lambda: chat.create(model=MODEL, messages=messages),
             lambda: chat.create(model=MODEL, messages=messages, stream=True,
                                 stream_options={"include_usage": True}),
             lambda: client.completions.create(model=MODEL, prompt="hi")]
    for call in calls:
        with pytest.raises(openai.BadRequestError):
            call()
    assert [sorted(body) for body in sent] == [
        ["messages", "model"], ["messages", "model", "stream", "stream_options"],
        ["model", "prompt"]]
    for kind, body in zip(["chat", "chat", "completion"], sent):
        parse(kind, body)


def test_top_logprobs_with_logprobs() -> None:
    req = parse("chat", {"logprobs": True, "top_logprobs": 20})
    assert req.sampling == SamplingParams(max_tokens=DEFAULT_MAX, logprobs=True,
                                          top_logprobs=20)
    for bad, why in (({"logprobs": True, "top_logprobs": 21}, "integer in [0, 20]"),
                     ({"logprobs": True, "top_logprobs": 2.5}, "integer in [0, 20]"),
                     ({"top_logprobs": 2}, "needs 'logprobs': true")):
        with pytest.raises(ApiError) as info:
            parse("chat", bad)
        assert info.value.param == "top_logprobs" and why in info.value.message
