"""A thinking model's answer split into ``reasoning_content`` and ``content``
(services/router/reasoning.py): exact cases of each parser, the same split whatever deltas
the answer comes in, and the chat responses built from it, streamed and whole, with tool
calls read from the content only."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import ClusterConfig
from common.protocol import TokenDelta
from services.router.handlers import _choices
from services.router.openai_format import ResponseBuilder
from services.router.reasoning import ThinkSplitter
from services.router.tool_response import TaggedCallsBuilder
from services.router.validation import parse_request


def split(parser: str, parts: list[str]) -> tuple[str, str]:
    s = ThinkSplitter(parser)
    reasoning = content = ""
    for part in parts:
        r, c = s.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("qwen3", "\n <think>a</think>b", ("a", "b")),
    ("qwen3", "<think>\n\n</think>\n\nParis.", ("\n\n", "\n\nParis.")),  # thinking off
    ("qwen3", "Paris. <think>not a block</think>", ("", "Paris. <think>not a block</think>")),
    ("qwen3", "<think>cut off", ("cut off", "")),
    ("qwen3", "<thin", ("", "<thin")),
    ("qwen3", "", ("", "")),
    ("deepseek_r1", "Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "<think>Let me see.</think>Paris.", ("Let me see.", "Paris.")),
    ("deepseek_r1", "still thinking </thi", ("still thinking </thi", "")),
    ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),
])
def test_each_parser_splits_as_written(parser: str, text: str, want: tuple) -> None:
    assert split(parser, [text]) == want
    assert split(parser, list(text)) == want  # one character a delta


_PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", " ",
                           "\n", "Paris", "a", "<", "/"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=12), cuts=st.lists(st.integers(0, 60), max_size=6),
       parser=st.sampled_from(["qwen3", "deepseek_r1"]))
def test_the_split_does_not_depend_on_the_deltas(pieces: list[str], cuts: list[int],
                                                 parser: str) -> None:
    """Any text cut anywhere splits as it does whole, and loses nothing: the parts joined
    are the text less the tags the parser took."""
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parts = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    whole = split(parser, [text])
    assert split(parser, parts) == whole
    assert len(whole[0]) + len(whole[1]) <= len(text)


def _builder(cls: type, reasoning: Optional[str] = "qwen3") -> ResponseBuilder:
    return cls(kind="chat", request_id="r", model="m", created=0, token_text=str,
               reasoning=reasoning)


def _stream(builder: ResponseBuilder, parts: list[str]) -> list[dict]:
    deltas = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        chunk = builder.absorb(TokenDelta("r", [i], part, None, "stop" if last else None,
                                          3, i + 1))
        if chunk is not None:
            deltas.append(chunk["choices"][0]["delta"])
    return deltas


def test_a_streamed_answer_adds_up_to_the_whole_message() -> None:
    parts = ["<th", "ink>The capital", " of France.</th", "ink>\n\nPar", "is."]
    builder = _builder(ResponseBuilder)
    deltas = _stream(builder, parts)
    assert all(deltas)  # no empty chunk: text held back sends nothing
    assert "".join(d.get("reasoning_content", "") for d in deltas) == \
        "The capital of France."
    assert "".join(d.get("content", "") for d in deltas) == "\n\nParis."
    assert builder.choice(0)["message"] == {"role": "assistant", "content": "\n\nParis.",
                                            "reasoning_content": "The capital of France."}
    plain = _builder(ResponseBuilder, None)
    _stream(plain, parts)
    assert plain.choice(0)["message"] == {"role": "assistant", "content": "".join(parts)}


def test_tool_calls_are_read_from_the_content_only() -> None:
    """The reasoning may mention a call; only the content's call is made."""
    parts = ["<think>I could <tool_call> here", "</think>", '<tool_call>{"name": "f", ',
             '"arguments": {"x": 1}}</tool_call>']
    builder = _builder(TaggedCallsBuilder)
    deltas = _stream(builder, parts)
    message = builder.choice(0)["message"]
    assert message["reasoning_content"] == "I could <tool_call> here"
    assert message["content"] is None and builder.finish_reason == "tool_calls"
    assert [c["function"] for c in message["tool_calls"]] == \
        [{"name": "f", "arguments": '{"x": 1}'}]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert streamed[0]["function"]["name"] == "f"


@pytest.mark.parametrize("body, split_it", [
    ({}, True),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, True),
    ({"response_format": {"type": "json_object"}}, False),
])
def test_only_free_answers_are_split(body: dict, split_it: bool) -> None:
    state = SimpleNamespace(tokenizer=SimpleNamespace(decode=lambda ids: ""),
                            config=ClusterConfig(reasoning_parser="qwen3"))
    req = parse_request({"messages": [{"role": "user", "content": "hi"}], **body}, "chat",
                        ("m",), 8)
    builder = _choices(state, req, "r").first
    assert (builder.think is not None) == split_it


def test_an_unknown_parser_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ClusterConfig(reasoning_parser="r1")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory):
    """(base URL, fake cluster) of a router with ``reasoning_parser = "qwen3"``."""
    from tests.router.conftest import own_router

    with own_router(tmp_path_factory.mktemp("router-reasoning"), "request_timeout_s = 5\n"
                    "heartbeat_interval_s = 0.2\nreasoning_parser = \"qwen3\"\n") as running:
        yield running


def test_the_official_client_reads_the_reasoning(thinking) -> None:
    """Over HTTP, as vLLM serves it: ``message.reasoning_content`` and the streamed
    ``delta.reasoning_content``, beside the content."""
    import openai

    from tests.router.fake_cluster import accepted, deltas

    url, fake = thinking
    words = ["<think>", "The capital", " is Paris.", "</th", "ink>", "\n\nParis."]
    fake.script = lambda req: [(0.0, accepted(req))] + deltas(req, words)
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", timeout=20)
    messages = [{"role": "user", "content": "Capital of France?"}]
    answer = client.chat.completions.create(model="smollm2-135m", messages=messages)
    message = answer.choices[0].message
    assert (message.content, message.model_extra["reasoning_content"]) == \
        ("\n\nParis.", "The capital is Paris.")
    stream = client.chat.completions.create(model="smollm2-135m", messages=messages,
                                            stream=True)
    got = {"content": "", "reasoning_content": ""}
    for chunk in stream:
        for key in got:
            got[key] += (chunk.choices[0].delta.model_dump().get(key) or "") \
                if chunk.choices else ""
    assert got == {"content": "\n\nParis.", "reasoning_content": "The capital is Paris."}
