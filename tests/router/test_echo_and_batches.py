"""The completions API as evaluation tools use it (lm-evaluation-harness): ``echo`` (the
prompt before the answer, with its own tokens' logprobs), ``max_tokens: 0`` and a list of
prompts in one request. Validation and rendering in-process; the batch and the echoed
logprobs over HTTP against the scripted cluster (the real prefill's numbers:
tests/e2e/test_echo.py)."""
from __future__ import annotations

from typing import Any

import pytest

from common.protocol import RequestFailed, SubmitRequest, TokenDelta
from common.sampling_params import PromptLogprobs, SamplingParams, TopLogprobs
from services.router.choices import Choices
from services.router.errors import ApiError
from services.router.openai_format import ResponseBuilder
from services.router.validation import MAX_PROMPTS, parse_request
from tests.router.fake_cluster import FakeCluster, accepted
from tests.router.http_client import post

MODEL = "smollm2-135m"
COMPL = "/v1/completions"


def parse(body: dict) -> Any:
    return parse_request({"prompt": "hi", **body}, "completion", (MODEL,), 7)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# ------------------------------------------------------------------ validation

def test_echo_with_logprobs_asks_the_prompt_logprobs_with_as_many_alternatives() -> None:
    assert parse({"echo": True, "logprobs": 3}).sampling == SamplingParams(
        7, logprobs=True, top_logprobs=3, prompt_logprobs=3)
    assert parse({"echo": True, "logprobs": 0}).sampling.prompt_logprobs == 0
    assert parse({"echo": True}).sampling.prompt_logprobs is None  # the text only
    assert parse({"logprobs": 2}).sampling.prompt_logprobs is None  # no echo


def test_max_tokens_zero_only_with_echo() -> None:
    assert parse({"echo": True, "max_tokens": 0}).sampling.max_tokens == 0
    for body in ({"max_tokens": 0}, {"echo": False, "max_tokens": 0},
                 {"max_completion_tokens": 0}):
        err = refused(body)
        assert err.param in ("max_tokens", "max_completion_tokens")
        assert "0 only with 'echo': true" in err.message


def test_echo_and_batches_are_not_streamed() -> None:
    err = refused({"echo": True, "stream": True})
    assert (err.param, err.code) == ("echo", "unsupported_value")
    assert "'stream': true" in err.message
    err = refused({"prompt": ["a", "b"], "stream": True})
    assert (err.param, err.code) == ("prompt", "unsupported_value")
    assert parse({"prompt": ["a"], "stream": True}).prompts == ["a"]  # a batch of one


def test_prompt_lists() -> None:
    assert parse({"prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert parse({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    assert parse({"prompt": ["a", [3]]}).prompts == ["a", [3]]  # OpenAI takes either
    assert refused({"prompt": ["a", ""]}).param == "prompt[1]"
    assert refused({"prompt": [[1], []]}).param == "prompt[1]"
    assert refused({"prompt": [[1, True]]}).param == "prompt"
    err = refused({"prompt": ["a"] * (MAX_PROMPTS + 1)})
    assert err.param == "prompt" and str(MAX_PROMPTS) in err.message


# ------------------------------------------------------------------ rendering

PROMPT_LPS = PromptLogprobs([-1.0, -2.0], [TopLogprobs([8, 5], [-0.5, -1.5]),
                                           TopLogprobs([5, 9], [-0.25, -2.0])])


def _builder(**kw: Any) -> ResponseBuilder:
    return ResponseBuilder("completion", "r", MODEL, 1, token_text=lambda t: f"<{t}>",
                           echo="<7><8><9>", prompt_ids=[7, 8, 9], **kw)


def _delta(tokens: list[int], text: str, finish: str | None, **kw: Any) -> TokenDelta:
    return TokenDelta("r", tokens, text, [-0.75] * len(tokens), finish, 3, len(tokens), 0,
                      **kw)


def test_echo_renders_the_prompt_then_the_answer_in_the_legacy_shape() -> None:
    out = _builder(want_logprobs=True, want_top=2)
    top = TopLogprobs([4, 1], [-0.75, -1.0])
    out.absorb(_delta([4], "<4>", "length", top_logprobs=[top], prompt_logprobs=PROMPT_LPS))
    assert out.choice(0) == {"index": 0, "text": "<7><8><9><4>", "finish_reason": "length",
                             "logprobs": {
        "tokens": ["<7>", "<8>", "<9>", "<4>"],
        "token_logprobs": [None, -1.0, -2.0, -0.75],
        "top_logprobs": [None, {"<8>": -0.5, "<5>": -1.5}, {"<5>": -0.25, "<9>": -2.0},
                         {"<4>": -0.75, "<1>": -1.0}],
        "text_offset": [0, 3, 6, 9]}}


def test_max_tokens_zero_echoes_the_prompt_alone() -> None:
    out = _builder(want_logprobs=True)  # logprobs: 0: no alternatives
    out.absorb(_delta([], "", "length", prompt_logprobs=PromptLogprobs([-1.0, -2.0])))
    assert out.choice(0)["text"] == "<7><8><9>"
    assert out.choice(0)["logprobs"] == {"tokens": ["<7>", "<8>", "<9>"],
                                         "token_logprobs": [None, -1.0, -2.0],
                                         "top_logprobs": None, "text_offset": [0, 3, 6]}
    plain = _builder()  # echo without logprobs: the text only
    plain.absorb(_delta([4], "<4>", "stop"))
    assert plain.choice(0)["text"] == "<7><8><9><4>" and plain.choice(0)["logprobs"] is None


def test_missing_prompt_logprobs_are_an_error_not_a_silent_gap() -> None:
    out = _builder(want_logprobs=True)
    out.absorb(_delta([4], "<4>", "length"))
    with pytest.raises(ApiError) as info:
        out.choice(0)
    assert info.value.status == 500


def test_every_choice_echoes_the_prompt_logprobs_of_choice_0s_first_delta() -> None:
    builders = [_builder(want_logprobs=True, index=i) for i in range(2)]
    choices = Choices(builders, 2)
    choices.take(_delta([4], "<4>", "length", prompt_logprobs=PromptLogprobs([-1.0, -2.0])))
    choices.take(_delta([5], "<5>", "length", index=1))
    got = choices.choices(base=4)
    assert [c["index"] for c in got] == [4, 5]
    assert [c["text"] for c in got] == ["<7><8><9><4>", "<7><8><9><5>"]
    assert [c["logprobs"]["token_logprobs"] for c in got] == [[None, -1.0, -2.0, -0.75]] * 2


# ------------------------------------------------------------------ over HTTP

def _answer(req: SubmitRequest, *, fail: bool = False) -> list[tuple[float, Any]]:
    """Each choice answers with its request's prompt length and its own index; choice 0's
    first delta carries prompt logprobs -position (where asked)."""
    if fail:
        return [(0.0, RequestFailed(req.request_id, 503, "boom", "no prefill"))]
    n, prompt = req.sampling.n, len(req.token_ids)
    lps = PromptLogprobs([-float(i) for i in range(1, prompt)]) \
        if req.sampling.prompt_logprobs is not None else None
    steps: list[tuple[float, Any]] = [(0.0, accepted(req))]
    for j in range(n):
        tokens = [] if req.sampling.max_tokens == 0 else [100 + j]
        steps.append((0.01 * (n - j), TokenDelta(
            req.request_id, tokens, f" p{prompt}c{j}" if tokens else "",
            [-0.5] if tokens and req.sampling.logprobs else None, "length", prompt,
            len(tokens), 0, index=j, prompt_logprobs=lps if j == 0 else None)))
    return steps


def test_a_list_of_prompts_is_one_request_each_choices_in_order(
        router: str, fake: FakeCluster) -> None:
    fake.script = _answer
    prompts = ["one", "one two three", "one two"]
    reply = post(router, COMPL, {"prompt": prompts, "n": 2, "max_tokens": 1})
    assert reply.status == 200, reply.body
    body = reply.json()
    submits = fake.submits()[-3:]
    lengths = [len(s.token_ids) for s in submits]
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert [c["text"] for c in body["choices"]] == [
        f" p{lengths[i]}c{j}" for i in range(3) for j in range(2)]
    assert [s.request_id for s in submits] == [f"{body['id']}-{i}" for i in range(3)]
    assert body["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 6,
                             "total_tokens": sum(lengths) + 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_max_tokens_zero_over_a_batch_of_token_id_prompts(
        router: str, fake: FakeCluster) -> None:
    fake.script = _answer
    prompts = [[9906, 1917], [504, 3575, 282]]
    reply = post(router, COMPL, {"prompt": prompts, "echo": True, "max_tokens": 0,
                                 "logprobs": 0})
    assert reply.status == 200, reply.body
    body = reply.json()
    assert [s.sampling.prompt_logprobs for s in fake.submits()[-2:]] == [0, 0]
    for choice, ids in zip(body["choices"], prompts):
        assert choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert choice["logprobs"]["token_logprobs"] == [None] + [
            -float(i) for i in range(1, len(ids))]
        assert choice["text"] == "".join(choice["logprobs"]["tokens"])
    assert body["usage"]["completion_tokens"] == 0


def test_one_failed_prompt_fails_the_batch_and_aborts_the_others(
        router: str, fake: FakeCluster) -> None:
    def script(req: SubmitRequest) -> list[tuple[float, Any]]:
        if req.request_id.endswith("-1"):
            return _answer(req, fail=True)
        return [(0.0, accepted(req))]  # never finishes: must be aborted
    fake.script = script
    reply = post(router, COMPL, {"prompt": ["a", "b", "c"], "max_tokens": 1})
    assert reply.status == 503 and reply.json()["error"]["code"] == "boom"
    rid = fake.submits()[-1].request_id.rsplit("-", 1)[0]
    assert fake.wait_abort(f"{rid}-0") is not None
    assert fake.wait_abort(f"{rid}-2") is not None


def test_streamed_echo_is_a_400_naming_echo(router: str) -> None:
    reply = post(router, COMPL, {"prompt": "hi", "echo": True, "stream": True})
    assert reply.status == 400
    assert reply.json()["error"]["param"] == "echo"
