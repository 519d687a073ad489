"""Tool calls through the router process (HTTP in front, a scripted decode stream behind):
the request goes out with the tools' structural tag and their system text, and the
scripted answer comes back split into content and tool_calls, streamed and not."""
from __future__ import annotations

import json

from common.protocol import SubmitRequest
from services.router.tokenizer import load_tokenizer
from tests.router.fake_cluster import FakeCluster, accepted, deltas
from tests.router.http_client import post

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
WORDS = ["Checking", " <tool", '_call>{"name": "get_weather", "arg', 'uments": {"city": ',
         '"Oslo"}}</tool_call>']
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}],
        "tools": TOOLS, "tool_choice": "required"}


def _script(req: SubmitRequest) -> list:
    return [(0.0, accepted(req))] + deltas(req, WORDS)


def test_a_call_comes_back_as_tool_calls(router: str, fake: FakeCluster) -> None:
    fake.script = _script
    reply = post(router, CHAT, BODY)
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    [call] = choice["message"]["tool_calls"]
    assert choice["message"]["content"] == "Checking"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert choice["finish_reason"] == "tool_calls"
    submit = fake.submits()[-1]
    fmt = json.loads(submit.sampling.response_format)
    assert fmt["type"] == "structural_tag" and fmt["format"]["at_least_one"] is True
    prompt = load_tokenizer(MODEL).decode(submit.token_ids)
    assert "get_weather" in prompt and "<tool_call>" in prompt


def test_a_streamed_call(router: str, fake: FakeCluster) -> None:
    fake.script = _script
    reply = post(router, CHAT, {**BODY, "stream": True})
    events = reply.events()
    assert events[-1] == "[DONE]"
    got = [e["choices"][0] for e in events[:-1]]
    call_id = got[2]["delta"]["tool_calls"][0]["id"]
    none = {"index": 0, "logprobs": None, "finish_reason": None}
    assert got == [
        {**none, "delta": {"role": "assistant", "content": None}},
        {**none, "delta": {"content": "Checking"}},  # " <tool", the header: held back
        {**none, "delta": {"tool_calls": [
            {"index": 0, "id": call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": '}}]}},
        {**none, "delta": {"tool_calls": [{"index": 0, "function": {
            "arguments": '"Oslo"}'}}]}},
        {**none, "delta": {}, "finish_reason": "tool_calls"}]
