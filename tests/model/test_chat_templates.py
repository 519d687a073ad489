"""A checkpoint's chat template (its tokenizer_config.json) renders here exactly as
transformers' ``apply_chat_template`` renders it: the same text and tokens, with tools,
with the template's own refusals."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.model.loader import _hf_tokenizer_spec
from common.model.tokenizer import Tokenizer
from tests.model.tiny_checkpoints import write_chat_tokenizer, write_checkpoint

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather <in one city> & its unit",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                  "city": {"type": "string", "description": "e.g. Paris"}}}}}]
CHATS = {
    "plain": [{"role": "user", "content": "Hello, world!"}],
    "system": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is the weather in Paris today?"},
               {"role": "assistant", "content": "Sunny."},
               {"role": "user", "content": "Count from one to ten."}],
}


@pytest.fixture(scope="module", params=["qwen", "gemma"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint({"qwen": "qwen3", "gemma": "gemma3_text"}[request.param], path)
    write_chat_tokenizer(path, request.param)
    from transformers import AutoTokenizer

    return request.param, Tokenizer(_hf_tokenizer_spec(str(path))), \
        AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_the_directory_template_renders_as_transformers_does(checkpoint, chat, tools) -> None:
    family, ours, theirs = checkpoint
    messages = CHATS[chat]
    want = theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True)
    assert ours.render_chat(messages, tools=tools) == want
    assert ours.apply_chat_template(messages, tools=tools) == theirs(
        want, add_special_tokens=False)["input_ids"]
    if tools and family == "qwen":  # the tools as written, keys in order, nothing escaped
        assert '"description": "Today\'s weather <in one city> & its unit"' in want


def test_a_template_refusal_is_the_templates_message(checkpoint) -> None:
    from jinja2.exceptions import TemplateError

    family, ours, _ = checkpoint
    if family != "gemma":
        pytest.skip("only the Gemma-style template refuses turns out of order")
    with pytest.raises(TemplateError, match="turns must alternate user/assistant"):
        ours.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_the_family_template_is_the_served_one(tmp_path: Path) -> None:
    """The router reads the same template and end of turn as the engine."""
    from services.router.tokenizer import load_tokenizer

    write_checkpoint("qwen3", tmp_path)
    ids = write_chat_tokenizer(tmp_path, "qwen")
    served = load_tokenizer(str(tmp_path))
    assert served.model_config.eos_token_ids == (ids["<|im_end|>"],)
    text = served.tokenizer.render_chat(CHATS["plain"])
    assert text == "<|im_start|>user\nHello, world!<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_template_kwargs_render_as_transformers_does(tmp_path: Path, kwargs: dict) -> None:
    """A request's ``chat_template_kwargs`` (Qwen 3's ``enable_thinking``) are the
    template's variables here as in transformers' ``apply_chat_template(**kwargs)``."""
    import json

    from transformers import AutoTokenizer

    write_checkpoint("qwen3", tmp_path)
    write_chat_tokenizer(tmp_path, "qwen")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] += ("{%- if add_generation_prompt and enable_thinking is defined "
                                "and enable_thinking is false %}<think>\n\n</think>\n\n"
                                "{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer(_hf_tokenizer_spec(str(tmp_path)))
    want = AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        CHATS["system"], tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render_chat(CHATS["system"], **kwargs) == want
    assert ("<think>" in want) == (kwargs.get("enable_thinking") is False)
