"""Hypothesis-generated API bodies against the router process: never a 5xx; every refusal
is an OpenAI-style JSON error (``{"error": {"message": str, "type": str, ...}}``).

The router runs as a subprocess wired to the scripted fake cluster (conftest.py), so a
body that passes validation is answered (200) and everything else must be a 4xx with a
message. Bodies: valid-ish requests with fields swapped for junk (wrong types, huge and
non-finite numbers, unicode, nested values), arbitrary JSON, truncated JSON, raw bytes.
"""
from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.router.http_client import Reply, request

MODEL = "smollm2-135m"
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens",
          "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
          "user", "echo", "best_of", "suffix", "response_format", "tools", "tool_choice",
          "parallel_tool_calls"]
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])

huge_ints = st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64 + 1, -(2 ** 63) - 1, 10 ** 30])
numbers = st.one_of(st.integers(-1000, 1000), huge_ints,
                    st.floats(allow_nan=True, allow_infinity=True))
texts = st.text(max_size=40) | st.sampled_from(["", "\x00", "\ud83d\ude00" * 5, "é" * 30,
                                                 "{{ raise_exception('x') }}", "<|im_end|>"])
scalars = st.none() | st.booleans() | numbers | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(texts, inner, max_size=4), max_leaves=12)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"])
                           | texts, "content": texts | json_values}),
    st.dictionaries(st.sampled_from(["role", "content", "name", "x", "tool_calls",
                                     "tool_call_id"]), json_values, max_size=3),
    json_values), max_size=3)


TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}
choices = st.sampled_from(["auto", "required", "none", {"type": "function", "function":
                                                        {"name": "f"}}]) | json_values


def valid_base(kind: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(kind, raw body): one of several shapes, from nearly valid to garbage."""
    kind = draw(st.sampled_from(["chat", "completion"]))
    shape = draw(st.sampled_from(["mutated", "fields", "any_json", "truncated", "bytes",
                                  "tools"]))
    body: Any = valid_base(kind)
    if shape == "tools":  # a valid tool, a choice and a tool history, each maybe junk
        body.update(tools=[TOOL], tool_choice=draw(choices),
                    parallel_tool_calls=draw(st.booleans() | json_values))
        call = {"id": "c", "type": "function",
                "function": {"name": "f", "arguments": draw(texts | json_values)}}
        body["messages"] = [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": None,
                             "tool_calls": draw(st.just([call]) | json_values)},
                            {"role": "tool", "tool_call_id": draw(st.just("c") | json_values),
                             "content": draw(texts | json_values)}]
    elif shape == "mutated":  # a valid request with a few fields set to junk
        for name in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            body[name] = draw(messages if name == "messages" else json_values)
    elif shape == "fields":  # only known field names, any values
        body = draw(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6))
    elif shape == "any_json":
        body = draw(json_values)
    if shape == "bytes":
        return kind, draw(st.binary(max_size=200))
    raw = json.dumps(body).encode()  # NaN/Infinity come out as invalid JSON: a 400 too
    if shape == "truncated":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    return kind, raw


def check_reply(reply: Reply) -> None:
    assert reply.status < 500, (reply.status, reply.body[:300])
    if reply.status == 200:
        return
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    err = reply.json()["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert {"param", "code"} <= set(err), err


def unavailable(reply: Reply) -> bool:
    """The router's 503 for a silent conductor: the fake cluster lives in this test's own
    process, which a loaded 2-core box can stop for over CONDUCTOR_TIMEOUT_S (seen once
    in CI: 1.3 s); a client is told to retry after a second, and does."""
    return reply.status == 503 and reply.json()["error"]["code"] == "cluster_unavailable"


@SETTINGS
@given(case=bodies())
def test_generated_bodies_never_5xx(router: str, case: tuple[str, bytes]) -> None:
    kind, raw = case
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    reply = request(router, "POST", path, raw=raw, timeout=15)
    if unavailable(reply):
        time.sleep(float(reply.headers.get("retry-after", "1")))
        reply = request(router, "POST", path, raw=raw, timeout=15)
    check_reply(reply)


@settings(SETTINGS, max_examples=40)
@given(raw=st.binary(max_size=64), path=st.sampled_from(
    ["/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/nope", "/health"]),
       method=st.sampled_from(["POST", "GET", "PUT", "DELETE"]))
def test_other_paths_and_methods_never_5xx(router: str, raw: bytes, path: str,
                                           method: str) -> None:
    reply = request(router, method, path, raw=raw or None, timeout=15)
    assert reply.status < 500 or (path == "/health" and reply.status == 503), reply.status


def test_router_still_answers_after_the_fuzz(router: str) -> None:
    reply = request(router, "POST", "/v1/chat/completions", body=valid_base("chat"))
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["message"]["content"] == "Hello world!"
