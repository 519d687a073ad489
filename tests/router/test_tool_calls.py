"""Splitting an answer's ``<tool_call>`` blocks into content and calls
(services/router/tool_calls.py) and their OpenAI chunks (services/router/
tool_response.py): exact events, the hold-back of a possible ``<tool_call>`` start, and
the same content and calls however the text is cut."""
from __future__ import annotations

import itertools
import json
from typing import Optional

import pytest

from common.protocol import TokenDelta
from services.router.tool_calls import (CallSplitter, Event, SplitAnswer, call_text,
                                        collect, split_answer, tools_prompt)
from services.router.tool_response import TaggedCallsBuilder, delta_of

WEATHER = call_text("get_weather", '{"city": "Oslo"}')
TIME = call_text("get_time", "{}")


def test_call_text_is_the_grammar_s_shape() -> None:
    assert WEATHER == '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
                      '</tool_call>'


@pytest.mark.parametrize("text, content, calls", [
    ("Just text.", "Just text.", []),
    ("", None, []),
    ("  \n", None, []),
    (WEATHER, None, [("get_weather", '{"city": "Oslo"}')]),
    (f"{WEATHER}\n{TIME}", None, [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (f"Let me check. {WEATHER} Done.", "Let me check.  Done.",
     [("get_weather", '{"city": "Oslo"}')]),
    # </tool_call> inside a string value does not end the call
    (call_text("f", '{"a": "}</tool_call>", "b": [1, {"c": "\\""}]}') + "after",
     "after", [("f", '{"a": "}</tool_call>", "b": [1, {"c": "\\""}]}')]),
    ("a <tool", "a <tool", []),  # held back, then content at the end
    ("a <tool_x> b", "a <tool_x> b", []),
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),  # cut header
    ("<tool_call>not a call at all " + "x" * 200, "<tool_call>not a call at all " + "x" * 200,
     []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1', None, [("f", '{"a": 1')]),  # cut
    ('<tool_call>{"name": "f", "arguments": {}}</x> t', "</x> t", [("f", "{}")]),
])
def test_split_answer(text: str, content: Optional[str], calls: list) -> None:
    assert split_answer(text) == SplitAnswer(content, calls)


def test_events_in_order_with_the_start_held_back() -> None:
    s = CallSplitter()
    assert s.feed("Hi <tool") == [Event("content", "Hi")]  # " <tool" may start a call
    assert s.feed("_call>") == []
    assert s.feed('{"name": "get_weather", ') == []  # the header is not complete
    assert s.feed('"arguments": {"ci') == [Event("call", "get_weather", 0),
                                           Event("arguments", '{"ci', 0)]
    assert s.feed('ty": "Oslo"}}</tool') == [Event("arguments", 'ty": "Oslo"}', 0)]
    assert s.feed("_call>\n") == []  # whitespace waits for more content
    assert s.feed("<") == []
    assert s.feed("b") == [Event("content", " \n<b")]  # with the space after "Hi"
    assert s.finish() == [] and s.calls == 1


@pytest.mark.parametrize("text", [
    f"Let me check. {WEATHER}\n{TIME} Done.",
    call_text("f", '{"a": "}</tool_call> <tool_call>", "b": "\\\\"}') + " x <tool",
    f"{WEATHER}\n{TIME}\n",
])
def test_any_cut_gives_the_same_answer(text: str) -> None:
    """Every way to cut the text in up to three pieces streams the same content and
    calls as the whole text."""
    whole = split_answer(text)
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        s, answer = CallSplitter(), SplitAnswer(None, [])
        events = s.feed(text[:i]) + s.feed(text[i:j]) + s.feed(text[j:]) + s.finish()
        collect(events, answer)
        assert answer == whole, (i, j)


def test_delta_of_opens_a_call_then_streams_its_arguments() -> None:
    events = [Event("content", "ok"), Event("call", "f", 0), Event("arguments", "{", 0),
              Event("arguments", "}", 0), Event("call", "g", 1)]
    assert delta_of(events, ["call_a", "call_b"]) == {"content": "ok", "tool_calls": [
        {"index": 0, "id": "call_a", "type": "function",
         "function": {"name": "f", "arguments": "{}"}},
        {"index": 1, "id": "call_b", "type": "function",
         "function": {"name": "g", "arguments": ""}}]}
    assert delta_of([Event("arguments", '"x"', 1)], ["call_a", "call_b"]) == {
        "tool_calls": [{"index": 1, "function": {"arguments": '"x"'}}]}


def _builder() -> TaggedCallsBuilder:
    return TaggedCallsBuilder(kind="chat", request_id="cmpl-1", model="m", created=0,
                              token_text=str)


def _delta(text: str, finish: Optional[str] = None) -> TokenDelta:
    return TokenDelta("cmpl-1", [1], text, None, finish, 5, 1)


def test_builder_streams_content_and_calls() -> None:
    out = _builder()
    assert out.role_chunk()["choices"][0]["delta"] == {"role": "assistant", "content": None}
    pieces = ["Sure <tool", '_call>{"name": "get_weather", "arguments": {"city"', ': "Oslo"}}',
              "</tool_call>"]
    deltas = [out.absorb(_delta(p)) for p in pieces] + [out.absorb(_delta("", "stop"))]
    assert [d and d["choices"][0]["delta"] for d in deltas] == [
        {"content": "Sure"},
        {"tool_calls": [{"index": 0, "id": out.call_ids[0], "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]},
        None, None]  # nothing to send: the end tag, then the end
    assert out.finish_chunk()["choices"][0]["finish_reason"] == "tool_calls"
    message = out.choice(0)["message"]
    assert message == {"role": "assistant", "content": "Sure", "tool_calls": [
        {"id": out.call_ids[0], "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}


def test_builder_flushes_held_text_at_the_end_and_keeps_length() -> None:
    out = _builder()
    assert out.absorb(_delta("a <tool")) is not None
    last = out.absorb(_delta("_c", "length"))
    assert last is not None and last["choices"][0]["delta"] == {"content": " <tool_c"}
    assert out.finish_reason == "length"
    assert out.choice(0)["message"] == {"role": "assistant",
                                                       "content": "a <tool_c"}


def test_builder_ids_are_unique_per_call() -> None:
    out = _builder()
    out.absorb(_delta(f"{WEATHER}\n{TIME}", "stop"))
    ids = [c["id"] for c in out.choice(0)["message"]["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)
    assert out.choice(0)["finish_reason"] == "tool_calls"


def test_tools_prompt_lists_every_function_and_the_format() -> None:
    fns = [{"name": "f", "parameters": {"type": "object"}}, {"name": "g"}]
    text = tools_prompt(fns)
    assert '{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}' \
        "\n" + '{"type": "function", "function": {"name": "g"}}' in text
    assert '<tool_call>{"name": <function-name>, "arguments": <arguments-json-object>}' \
           "</tool_call>" in text
