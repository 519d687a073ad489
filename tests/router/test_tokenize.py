"""/tokenize and /detokenize bodies against the real SmolLM2 tokenizer and the byte
tokenizer of the dummy models, in-process (the HTTP side: test_tokenize_http.py)."""
from __future__ import annotations

from typing import Any

import pytest

from services.router.errors import ApiError
from services.router.tokenize import parse_detokenize, parse_tokenize, tokenize
from services.router.tokenizer import PromptTokenizer, load_tokenizer

MODEL = "smollm2-135m"
USER = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol() -> PromptTokenizer:
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def byte() -> PromptTokenizer:
    return load_tokenizer("dummy-tiny")


def run(tok: PromptTokenizer, body: dict) -> dict:
    return tokenize(tok, parse_tokenize(body, (MODEL,)))


def test_prompt_matches_the_completions_encoding(smol: PromptTokenizer) -> None:
    out = run(smol, {"model": MODEL, "prompt": "hello world"})
    assert out == {"count": 2, "max_model_len": 8192, "tokens": [28120, 905],
                   "token_strs": None}
    assert out["tokens"] == smol.encode_text("hello world")
    assert run(smol, {"prompt": "hello world", "return_token_strs": True})["token_strs"] \
        == ["hello", "Ġworld"]


def test_messages_match_the_chat_encoding(smol: PromptTokenizer) -> None:
    out = run(smol, {"messages": USER})
    assert out["tokens"] == smol.encode_chat(USER) and out["count"] == len(out["tokens"])
    bare = run(smol, {"messages": USER, "add_generation_prompt": False})["tokens"]
    assert out["tokens"][:len(bare)] == bare and len(out["tokens"]) > len(bare)
    assert smol.decode(out["tokens"][len(bare):]) == "<|im_start|>assistant\n"


def test_add_special_tokens_with_a_bos_tokenizer(byte: PromptTokenizer) -> None:
    """The byte tokenizer adds BOS (1): prompts get it by default, chat only on request
    (on top of the template's own)."""
    assert run(byte, {"prompt": "A"})["tokens"] == [1, 65 + 3]
    assert run(byte, {"prompt": "A", "add_special_tokens": False})["tokens"] == [65 + 3]
    chat = run(byte, {"messages": [{"role": "user", "content": "A"}]})["tokens"]
    assert chat == byte.encode_chat([{"role": "user", "content": "A"}]) and chat[0] == 1
    extra = run(byte, {"messages": [{"role": "user", "content": "A"}],
                       "add_special_tokens": True})["tokens"]
    assert extra == [1] + chat
    assert run(byte, {"prompt": "A", "return_token_strs": True})["token_strs"] == \
        ["<1>", "<0x41>"]


def test_detokenize_round_trip(smol: PromptTokenizer) -> None:
    ids = run(smol, {"messages": USER})["tokens"]
    text = smol.decode(parse_detokenize({"tokens": ids}, smol, (MODEL,)))
    assert text.startswith("<|im_start|>system\n") and "capital of France?" in text
    assert smol.decode(parse_detokenize({"model": MODEL, "tokens": []}, smol, (MODEL,))) == ""


@pytest.mark.parametrize("body, param", [
    ([], None),
    ({}, "prompt"),
    ({"prompt": "a", "messages": USER}, "messages"),
    ({"prompt": ["a"]}, "prompt"),
    ({"prompt": "a", "model": "gpt-4"}, "model"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ({"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
    ({"messages": USER, "chat_template": "{{ messages }}"}, "chat_template"),
    ({"messages": USER, "chat_template_kwargs": {"tools": 1}}, "chat_template_kwargs.tools"),
    ({"prompt": "a", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
])
def test_tokenize_refusals(smol: PromptTokenizer, body: Any, param: str) -> None:
    with pytest.raises(ApiError) as info:
        run(smol, body)
    assert (info.value.status, info.value.param) == (400, param), info.value.message


def test_tools_are_shown_as_a_chat_request_with_them_shows_them(
        smol: PromptTokenizer) -> None:
    fn = {"name": "get_weather", "parameters": {"type": "object"}}
    out = run(smol, {"messages": USER, "tools": [{"type": "function", "function": fn}]})
    assert out["tokens"] == smol.encode_chat(USER, tools=[fn]) != smol.encode_chat(USER)
    assert "get_weather" in smol.decode(out["tokens"])


def test_tokenize_accepts_vllm_defaults(smol: PromptTokenizer) -> None:
    """vLLM's options at their off values are fine (a client may send them all)."""
    body = {"messages": USER, "continue_final_message": False, "chat_template": None,
            "chat_template_kwargs": {}, "tools": [], "add_special_tokens": False}
    assert run(smol, body)["tokens"] == smol.encode_chat(USER)


@pytest.mark.parametrize("body, param", [
    ({}, "tokens"),
    ({"tokens": "1 2"}, "tokens"),
    ({"tokens": [1, True]}, "tokens"),
    ({"tokens": [1, 49152]}, "tokens"),
    ({"tokens": [-1]}, "tokens"),
    ({"tokens": [1], "prompt": "x"}, "prompt"),
    ({"tokens": [1], "model": "gpt-4"}, "model"),
])
def test_detokenize_refusals(smol: PromptTokenizer, body: dict, param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_detokenize(body, smol, (MODEL,))
    assert (info.value.status, info.value.param) == (400, param), info.value.message
