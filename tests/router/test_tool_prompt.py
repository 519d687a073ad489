"""The tools reach the model's prompt (services/router/tokenizer.py encode_chat): SmolLM2's
chat template ignores ``tools``, so they come as a system text merged into the first
system message; a template that renders ``tools`` gets them itself. Checked on the ids a
chat request is submitted with (handlers._tokenize)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest

from common.model.tokenizer import Tokenizer
from services.router.errors import ApiError
from services.router.handlers import _tokenize
from services.router.tokenizer import PromptTokenizer, load_tokenizer, with_tools_prompt
from services.router.tool_calls import tools_prompt
from services.router.validation import parse_request

MODEL = "smollm2-135m"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "lookup_zebra"}}]
USER = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def smol() -> PromptTokenizer:
    return load_tokenizer(MODEL)


def _prompt(tok: PromptTokenizer, choice: Any, messages: Optional[list] = None) -> str:
    body = {"messages": messages or USER, "tools": TOOLS, "tool_choice": choice}
    req = parse_request(body, "chat", (MODEL,), 16)
    return tok.decode(_tokenize(SimpleNamespace(tokenizer=tok), req))


@pytest.mark.parametrize("choice", [None, "auto", "required",
                                    {"type": "function", "function": {"name": "lookup_zebra"}}])
def test_the_tools_are_in_the_prompt(smol: PromptTokenizer, choice: Any) -> None:
    text = _prompt(smol, choice)
    system = tools_prompt([t["function"] for t in TOOLS])
    assert text == f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n" \
                   "Weather in Oslo?<|im_end|>\n<|im_start|>assistant\n"
    assert "get_weather" in text and "lookup_zebra" in text and "<tool_call>" in text


def test_no_tools_in_the_prompt_when_no_call_may_be_made(smol: PromptTokenizer) -> None:
    text = _prompt(smol, "none")
    assert "get_weather" not in text and "<tool_call>" not in text
    assert text == smol.decode(smol.encode_chat(USER))


def test_merged_into_the_first_system_message(smol: PromptTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    text = _prompt(smol, "auto", messages)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1
    fns = [t["function"] for t in TOOLS]
    assert with_tools_prompt([{"role": "system", "content": ""}], fns) == [
        {"role": "system", "content": tools_prompt(fns)}]


def test_a_template_that_renders_tools_gets_them(smol: PromptTokenizer) -> None:
    spec = {"tokenizer_json": smol.tokenizer._tk.to_str(),
            "chat_template": "{% for t in tools or [] %}[{{ t['function']['name'] }}]"
                             "{% endfor %}{% for m in messages %}{{ m['content'] }}"
                             "{% endfor %}"}
    tok = PromptTokenizer(Tokenizer(spec), smol.model_config)
    assert _prompt(tok, "auto") == "[get_weather][lookup_zebra]Weather in Oslo?"
    assert _prompt(tok, "none") == "Weather in Oslo?"


def test_a_template_without_a_system_turn_gets_them_in_the_first_user_message(
        smol: PromptTokenizer) -> None:
    """Gemma 2's template refuses a system message: the tools' text opens the user's."""
    spec = {"tokenizer_json": smol.tokenizer._tk.to_str(),
            "chat_template": "{% for m in messages %}{% if m['role'] == 'system' %}"
                             "{{ raise_exception('System role not supported') }}{% endif %}"
                             "<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"}
    tok = PromptTokenizer(Tokenizer(spec), smol.model_config)
    system = tools_prompt([t["function"] for t in TOOLS])
    assert _prompt(tok, "auto") == f"<user>{system}\n\nWeather in Oslo?"
    with pytest.raises(ApiError, match="System role not supported"):  # refused either way
        _prompt(tok, "auto", [{"role": "system", "content": "Be brief."}, *USER])


THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
            "enable_thinking is false %}<think></think>{% endif %}{% endif %}")


def _thinking(smol: PromptTokenizer) -> PromptTokenizer:
    spec = {"tokenizer_json": smol.tokenizer._tk.to_str(), "chat_template": THINKING}
    return PromptTokenizer(Tokenizer(spec), smol.model_config)


@pytest.mark.parametrize("kwargs, want", [
    (None, "<user>Weather in Oslo?<assistant>"),
    ({"enable_thinking": False}, "<user>Weather in Oslo?<assistant><think></think>"),
    ({"enable_thinking": True, "unread": [1, {"a": None}]}, "<user>Weather in Oslo?<assistant>"),
])
def test_chat_template_kwargs_reach_the_template(smol: PromptTokenizer, kwargs: Any,
                                                 want: str) -> None:
    """Qwen 3's switch, as vLLM and SGLang take it: on the ids a chat request is
    submitted with and on /tokenize's; a variable the template does not read changes
    nothing."""
    from services.router.tokenize import parse_tokenize, tokenize

    tok = _thinking(smol)
    req = parse_request({"messages": USER, "chat_template_kwargs": kwargs}, "chat", (MODEL,), 16)
    ids = _tokenize(SimpleNamespace(tokenizer=tok), req)
    assert tok.decode(ids) == want
    body = {"messages": USER, "chat_template_kwargs": kwargs}
    assert tokenize(tok, parse_tokenize(body, (MODEL,)))["tokens"] == ids


@pytest.mark.parametrize("kwargs, param", [
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"bos_token": "<x>"}, "chat_template_kwargs.bos_token"),
    ({"not a name": 1}, "chat_template_kwargs.not a name"),
    ([["enable_thinking", False]], "chat_template_kwargs"),
    ({f"v{i}": i for i in range(33)}, "chat_template_kwargs"),
])
def test_chat_template_kwargs_may_not_set_what_the_server_renders(kwargs: Any,
                                                                  param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request({"messages": USER, "chat_template_kwargs": kwargs}, "chat", (MODEL,), 16)
    assert (info.value.status, info.value.body()["error"]["param"]) == (400, param)


def test_an_assistants_reasoning_reaches_the_template(smol: PromptTokenizer) -> None:
    """A reasoning parser's ``reasoning_content``, sent back in the history, is the
    template's to show (Qwen 3's shows it after the last user message)."""
    spec = {"tokenizer_json": smol.tokenizer._tk.to_str(),
            "chat_template": "{% for m in messages %}{% if m.reasoning_content %}<think>"
                             "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}|"
                             "{% endfor %}"}
    tok = PromptTokenizer(Tokenizer(spec), smol.model_config)
    history = [*USER, {"role": "assistant", "content": "Rain.", "reasoning_content": "Oslo."}]
    req = parse_request({"messages": history}, "chat", (MODEL,), 16)
    assert tok.decode(_tokenize(SimpleNamespace(tokenizer=tok), req)) == \
        "Weather in Oslo?|<think>Oslo.</think>Rain.|"
