"""Chat ``messages`` as the template receives them (services/router/chat_messages.py):
every key of a message honoured or refused with a 400 naming ``messages[i].<key>``, and
an assistant's tool calls rendered as the model writes them."""
from __future__ import annotations

from typing import Optional

import pytest

from services.router.errors import ApiError
from services.router.validation import GenerationRequest, parse_request


def parse(kind: str, body: dict) -> GenerationRequest:
    return parse_request(body, kind, ("smollm2-135m",), 7)

MESSAGE_CASES = [  # (message, parsed or None, param of the 400)
    ({"role": "developer", "content": "d"}, {"role": "system", "content": "d"}, None),
    ({"role": "user", "content": "u", "name": "ann"},
     {"role": "user", "content": "u", "name": "ann"}, None),
    ({"role": "assistant", "content": "a", "reasoning_content": "r"},
     {"role": "assistant", "content": "a", "reasoning_content": "r"}, None),
    ({"role": "assistant", "content": "a", "reasoning_content": ["r"]},
     None, "messages[0].reasoning_content"),
    ({"role": "user", "content": "u", "reasoning_content": "r"},
     None, "messages[0].reasoning_content"),
    ({"role": "assistant", "content": "a", "tool_calls": [], "refusal": None},
     {"role": "assistant", "content": "a"}, None),
    ({"role": "assistant", "content": "a", "tool_calls": [{"id": "c", "type": "function"}]},
     None, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
     {"role": "assistant", "content": '<tool_call>{"name": "f", "arguments": {}}</tool_call>'},
     None),
    ({"role": "assistant", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"},
         "x": 1}]}, None, "messages[0].tool_calls[0].x"),
    ({"role": "assistant", "content": "a", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}",
                                                     "strict": True}}]},
     None, "messages[0].tool_calls[0].function.strict"),
    ({"role": "assistant", "content": None}, None, "messages[0].content"),
    ({"role": "tool", "content": "r", "tool_call_id": "c"}, None,
     "messages[0].tool_call_id"),  # no earlier call has that id
    ({"role": "tool", "content": "r"}, None, "messages[0].tool_call_id"),
    ({"role": "user", "content": "u", "tool_call_id": "c"}, None, "messages[0].tool_call_id"),
    ({"role": "function", "content": "r", "name": "f"}, None, "messages[0].role"),
    ({"role": "user", "content": "u", "name": 3}, None, "messages[0].name"),
    ({"role": "user", "content": "u", "weight": 1}, None, "messages[0].weight"),
    ({"role": "user", "content": [{"type": "text", "text": "t", "cache": 1}]}, None,
     "messages[0].content[0].cache"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, None,
     "messages[0].content"),
]


@pytest.mark.parametrize("message, parsed, param", MESSAGE_CASES)
def test_message_keys(message: dict, parsed: Optional[dict], param: Optional[str]) -> None:
    if param is None:
        assert parse("chat", {"messages": [message]}).messages == [parsed]
        return
    with pytest.raises(ApiError) as info:
        parse("chat", {"messages": [message]})
    assert info.value.param == param, info.value.message


def test_tool_history_round_trip() -> None:
    """An assistant's calls are rendered as the model writes them (text first, one call
    per line; arguments that are not JSON become a JSON string); a tool message keeps
    its role and id, which must name an earlier call."""
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "x"}}]
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text",
                                                                     "text": "42"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "7"},
                {"role": "assistant", "content": "49"}]
    assert parse("chat", {"messages": messages}).messages == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": 'Let me see.\n<tool_call>{"name": "f", "arguments": '
                                         '{"a": 1}}</tool_call>\n<tool_call>{"name": "g", '
                                         '"arguments": "x"}</tool_call>'},
        {"role": "tool", "content": "42", "tool_call_id": "c2"},
        {"role": "tool", "content": "7", "tool_call_id": "c1"},
        {"role": "assistant", "content": "49"}]
    with pytest.raises(ApiError) as info:  # the answer comes before its call
        parse("chat", {"messages": [messages[0], messages[3], messages[1]]})
    assert info.value.param == "messages[1].tool_call_id"
