"""Request validation and response formatting, in-process (no sockets, no tokenizer)."""
from __future__ import annotations

import pytest

from common.protocol import TokenDelta
from services.router.errors import ApiError
from services.router.choices import Choices
from services.router.openai_format import ResponseBuilder
from common.sampling_params import SamplingParams, TopLogprobs
from services.router.validation import GenerationRequest, parse_request

MODEL = "smollm2-135m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
DEFAULT_MAX = 7  # the config's default_max_tokens


def test_chat_defaults() -> None:
    req = parse_request(CHAT, "chat", (MODEL,), DEFAULT_MAX)
    assert req.messages == [{"role": "user", "content": "hi"}]
    assert not req.stream and not req.include_usage
    assert req.sampling == SamplingParams(max_tokens=7)  # the server default, not asked
    assert not req.max_tokens_asked
    no_top_k = parse_request(dict(CHAT, top_k=-1), "chat", (MODEL,), DEFAULT_MAX)
    assert no_top_k.sampling.top_k is None


def test_chat_full_parameters() -> None:
    body = dict(CHAT, max_completion_tokens=5, temperature=0, top_p=0.5, top_k=3, seed=7,
                stop="x", n=1, stream=True, stream_options={"include_usage": True},
                logprobs=True, messages=[{"role": "system", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])
    req = parse_request(body, "chat", (MODEL,), DEFAULT_MAX)
    assert req.messages == [{"role": "system", "content": "ab"}]
    assert req.stream and req.include_usage
    assert req.sampling == SamplingParams(max_tokens=5, temperature=0.0, top_p=0.5, top_k=3,
                                          seed=7, stop=("x",), logprobs=True)
    assert req.max_tokens_asked


def test_completion_prompts() -> None:
    def completion(body: dict) -> GenerationRequest:
        return parse_request(body, "completion", (MODEL,), DEFAULT_MAX)

    assert completion({"prompt": "abc"}).prompt == "abc"
    assert completion({"prompt": [1, 2]}).prompt == [1, 2]
    assert completion({"prompt": ["abc"]}).prompt == "abc"
    assert completion({"prompt": "a", "logprobs": 0}).sampling.logprobs is True
    assert completion({"prompt": "a", "max_tokens": 9}).sampling.max_tokens == 9


@pytest.mark.parametrize("body,param,code", [
    ({"messages": []}, "messages", "invalid_value"),
    ({}, "messages", "missing_required_parameter"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role",
     "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id",
     "missing_required_parameter"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "invalid_value"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_type"),
    (dict(CHAT, model="gpt-4"), "model", "model_not_found"),
    (dict(CHAT, max_tokens=0), "max_tokens", "invalid_value"),
    (dict(CHAT, max_tokens=True), "max_tokens", "invalid_value"),
    (dict(CHAT, max_completion_tokens=-1), "max_completion_tokens", "invalid_value"),
    (dict(CHAT, top_p=0), "top_p", "invalid_value"),
    (dict(CHAT, top_k=0), "top_k", "invalid_value"),
    (dict(CHAT, stop=["a"] * 5), "stop", "invalid_value"),
    (dict(CHAT, stop=[""]), "stop", "invalid_type"),
    (dict(CHAT, n=0), "n", "invalid_value"),
    (dict(CHAT, seed=1 << 63), "seed", "invalid_value"),  # the wire carries 64 bits
    (dict(CHAT, n=1.5), "n", "invalid_value"),
    (dict(CHAT, logprobs=1), "logprobs", "invalid_type"),
    (dict(CHAT, stream_options={"include_usage": True}), "stream_options", "invalid_value"),
])
def test_chat_rejects(body: dict, param: str, code: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_request(body, "chat", (MODEL,), DEFAULT_MAX)
    err = info.value
    assert (err.status, err.param, err.code) == (400, param, code)
    assert err.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", ["", [], [1.5], {"a": 1}, [[1], "a", 2], [[1, 1.5]],
                                    None])
def test_completion_rejects_bad_prompts(prompt: object) -> None:
    with pytest.raises(ApiError) as info:
        parse_request({"prompt": prompt}, "completion", (MODEL,), DEFAULT_MAX)
    assert info.value.param == "prompt"


@pytest.mark.parametrize("body, why", [
    ({"best_of": 2, "n": 3}, "must be an integer in \\[n, 16\\] \\(n = 3\\)"),
    ({"best_of": 17}, "must be an integer in"),
    ({"best_of": True}, "must be an integer in"),
    ({"best_of": 3, "stream": True}, "cannot be streamed"),
])
def test_best_of_is_at_least_n_at_most_16_and_not_streamed(body: dict, why: str) -> None:
    with pytest.raises(ApiError, match=why) as info:
        parse_request({"prompt": "hi", **body}, "completion", (MODEL,), DEFAULT_MAX)
    assert info.value.param == "best_of"
    req = parse_request({"prompt": "hi", "n": 2, "best_of": 2, "stream": True}, "completion",
                        (MODEL,), DEFAULT_MAX)
    assert (req.returned, req.sampling.n) == (2, 2)  # best_of = n streams


def _delta(text: str, n: int, finish: str | None = None) -> TokenDelta:
    return TokenDelta("r", [n], text, [-1.0], finish, prompt_tokens=5, completion_tokens=n,
                      cached_tokens=2)


def test_builder_renders_top_logprobs_in_both_shapes() -> None:
    top = TopLogprobs([1, 9, 4], [-0.5, -1.0, -2.0])
    delta = TokenDelta("r", [1], "ab", [-0.5], "length", 5, 1, 0, [top])
    chat = ResponseBuilder("chat", "r", MODEL, 1, token_text=lambda t: f"<{t}>",
                           want_logprobs=True, want_top=3)
    streamed = chat.absorb(delta)["choices"][0]["logprobs"]["content"]
    assert streamed == chat.choice(0)["logprobs"]["content"] == [{
        "token": "<1>", "logprob": -0.5, "bytes": list(b"<1>"), "top_logprobs": [
            {"token": "<1>", "logprob": -0.5, "bytes": list(b"<1>")},
            {"token": "<9>", "logprob": -1.0, "bytes": list(b"<9>")},
            {"token": "<4>", "logprob": -2.0, "bytes": list(b"<4>")}]}]
    legacy = ResponseBuilder("completion", "r", MODEL, 1,  # ids 9 and 4 print alike
                             token_text=lambda t: "x" if t in (9, 4) else "ab",
                             want_logprobs=True, want_top=3)
    legacy.absorb(delta)
    assert legacy.choice(0)["logprobs"]["top_logprobs"] == [
        {"ab": -0.5, "x": -1.0}]  # one text: the likelier of the two


def test_builder_completion_logprobs_and_usage() -> None:
    out = ResponseBuilder("completion", "r", MODEL, 1, token_text=lambda t: f"<{t}>",
                          want_logprobs=True)
    out.absorb(_delta("ab", 1))
    out.absorb(_delta("c", 2, "length"))
    body = Choices([out], 1).response()
    assert body["choices"] == [{"index": 0, "text": "abc", "finish_reason": "length",
                                "logprobs": {"tokens": ["<1>", "<2>"],
                                             "token_logprobs": [-1.0, -1.0],
                                             "top_logprobs": None, "text_offset": [0, 3]}}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2}}


def _choice_delta(index: int, text: str, n: int, lp: float,
                  finish: str | None = None) -> TokenDelta:
    return TokenDelta("r", [n], text, [lp], finish, 5, n, 2, index=index)


def _builders(kind: str, n: int, **kw: object) -> list[ResponseBuilder]:
    return [ResponseBuilder(kind, "r", MODEL, 1, token_text=str, index=i, **kw)  # type: ignore[arg-type]
            for i in range(n)]


def test_choices_interleave_and_each_ends_with_its_own_finish_chunk() -> None:
    out = Choices(_builders("chat", 2, include_usage=True), 2)
    assert [c["choices"][0]["index"] for c in out.role_chunks()] == [0, 1]
    streamed = [out.absorb(d) for d in (
        _choice_delta(1, "x", 1, -1.0), _choice_delta(0, "a", 1, -1.0),
        _choice_delta(1, "y", 2, -1.0, "stop"), _choice_delta(0, "b", 2, -1.0),
        _choice_delta(0, "c", 3, -1.0, "length"))]
    assert [[(c["choices"][0]["index"], c["choices"][0]["delta"].get("content"),
              c["choices"][0]["finish_reason"]) for c in chunks] for chunks in streamed] == [
        [(1, "x", None)], [(0, "a", None)], [(1, "y", None), (1, None, "stop")],
        [(0, "b", None)], [(0, "c", None), (0, None, "length")]]
    body = out.response()
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in body["choices"]] == [(0, "abc", "length"), (1, "xy", "stop")]
    assert body["usage"]["completion_tokens"] == 5  # every choice's tokens
    assert out.usage_chunk()["usage"] == body["usage"]


def test_best_of_returns_the_likeliest_choices_renumbered() -> None:
    out = Choices(_builders("completion", 3), 1)
    for d in (_choice_delta(0, "a", 1, -2.0, "stop"), _choice_delta(1, "b", 1, -0.5),
              _choice_delta(1, "c", 2, -1.0, "stop"), _choice_delta(2, "d", 1, -1.0, "stop")):
        out.of(d).absorb(d)
    body = out.response()  # cumulative: -2.0, -1.5, -1.0
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [
        (0, "d", None)]  # logprobs were not asked: ranked on them, not shown
    assert body["usage"]["completion_tokens"] == 4
    two = Choices(out.builders, 2).response()["choices"]
    assert [(c["index"], c["text"]) for c in two] == [(0, "d"), (1, "bc")]
    with pytest.raises(ValueError):
        Choices(out.builders, 4)


def test_a_model_naming_an_adapter_runs_on_it() -> None:
    served = (MODEL, "sql", "chat-tuned")
    assert parse_request(CHAT, "chat", served, DEFAULT_MAX).sampling.adapter is None
    req = parse_request(dict(CHAT, model="sql"), "chat", served, DEFAULT_MAX)
    assert (req.model, req.sampling.adapter) == ("sql", "sql")
    with pytest.raises(ApiError) as info:
        parse_request(dict(CHAT, model="other"), "chat", served, DEFAULT_MAX)
    assert info.value.param == "model" and info.value.code == "model_not_found"
    assert "serves 'smollm2-135m', 'sql', 'chat-tuned'" in info.value.message


def test_a_continuation_runs_on_its_adapter_and_names_its_blocks_so() -> None:
    """A stream on a LoRA adapter whose decode worker died goes on on the same adapter,
    its prompt's blocks keyed as the adapter's (services/router/resume.py)."""
    from common.protocol import RequestFailed, SubmitRequest
    from services.router.resume import Resumable

    asked: list[tuple[list[int], object]] = []

    def keys(ids: list[int], adapter: object = None) -> list[str]:
        asked.append((ids, adapter))
        return [f"{adapter}:{len(ids)}"]

    original = SubmitRequest("r", [1, 2, 3], keys([1, 2, 3], "sql"),
                             SamplingParams(max_tokens=8, adapter="sql"), 0.0)
    run = Resumable(original)
    run.record(TokenDelta("r", [7, 8], "ab", None, None, 3, 2, 0))
    again = run.continuation(RequestFailed("r", 503, "worker_lost", "gone", resumable=True),
                             keys)
    assert again is not None and again.sampling.adapter == "sql"
    assert again.token_ids == [1, 2, 3, 7, 8] and again.block_keys == ["sql:5"]
    assert asked[-1] == ([1, 2, 3, 7, 8], "sql")
