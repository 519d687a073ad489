"""The official ``openai`` client against a real cluster: a field Crescent does not honour
is an ``openai.BadRequestError`` naming it, and what clients rely on keeps working
(max_completion_tokens, system messages, content parts, stream_options.include_usage,
usage.prompt_tokens_details.cached_tokens, vLLM extensions in ``extra_body``); /tokenize
counts exactly the prompt tokens a generation request is billed for."""
from __future__ import annotations

from typing import Any

import httpx
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import SharedClusters, wait_no_leaks

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]
SYSTEM = "You are a terse geography assistant. Answer in one short sentence. " * 4


@pytest.fixture(scope="module")
def cluster(shared: SharedClusters) -> LocalCluster:
    return shared.get("disaggregated")


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


CHAT_REFUSED = [  # (what the caller sets, the param the 400 names)
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"response_format": {"type": "json_schema", "json_schema": {  # cannot be compiled
        "name": "bad", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"store": True}, "store"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),  # outside smollm2's 49,152 ids
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"n": 17}, "n"),  # at most 16 choices
    ({"extra_body": {"min_p": 0.1}}, "min_p"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
]
COMPLETION_REFUSED = [({"echo": True, "stream": True}, "echo"),  # e2e/test_echo.py
                      ({"n": 3, "best_of": 2}, "best_of"),
                      ({"logprobs": 6}, "logprobs"), ({"suffix": "end"}, "suffix")]


def _refusal(create: Any, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(**kwargs)
    err = info.value
    assert (err.status_code, err.param, err.type) == (400, param, "invalid_request_error")
    assert param in err.message


def test_refused_fields_are_named(cluster: LocalCluster, client: Any) -> None:
    for kwargs, param in CHAT_REFUSED:
        _refusal(client.chat.completions.create, dict(model=MODEL, messages=PARIS,
                                                      max_completion_tokens=4, **kwargs),
                 param)
    for kwargs, param in COMPLETION_REFUSED:
        _refusal(client.completions.create, dict(model=MODEL, prompt="Paris is",
                                                 max_tokens=4, **kwargs), param)
    wait_no_leaks(cluster)  # a refusal reserves nothing


def test_what_clients_rely_on_keeps_working(cluster: LocalCluster, client: Any) -> None:
    parts = [{"type": "text", "text": "What is the capital"},
             {"type": "text", "text": " of France?"}]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]
    kwargs = dict(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0,
                  user="user-1", metadata={"suite": "e2e"}, store=False,
                  service_tier="auto", tool_choice="none", extra_body={"top_k": 1})
    first = client.chat.completions.create(**kwargs)
    assert 0 < first.usage.completion_tokens <= 8 and first.choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and text == first.choices[0].message.content
    assert usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    counted = httpx.post(cluster.url + "/tokenize", json={"messages": messages}, timeout=30)
    assert counted.json()["count"] == first.usage.prompt_tokens
    wait_no_leaks(cluster)


def test_vllm_extensions_in_extra_body(cluster: LocalCluster, client: Any) -> None:
    out = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0,
                                         max_completion_tokens=40, logprobs=True,
                                         extra_body={"ignore_eos": True})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (40, "length")
    content = out.choices[0].logprobs.content
    assert len(content) == 40 and all(c.logprob <= 0 and c.top_logprobs == []
                                      for c in content)
    wait_no_leaks(cluster)


def test_tokenize_round_trip(cluster: LocalCluster) -> None:
    text = "The Eiffel Tower is in Paris."
    tokens = httpx.post(cluster.url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                         "return_token_strs": True},
                        timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"])
    assert tokens["max_model_len"] == 8192
    back = httpx.post(cluster.url + "/detokenize", json={"tokens": tokens["tokens"]},
                      timeout=30)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    bad = httpx.post(cluster.url + "/detokenize", json={"tokens": [10 ** 9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_logit_bias_and_penalties_change_what_is_sampled(cluster: LocalCluster,
                                                         client: Any) -> None:
    """logit_bias +100 on one token makes greedy sampling pick it at every position (the
    first on the prefill worker, the rest on the decode worker); frequency and presence
    penalties make a greedy answer that repeats itself use more distinct tokens."""
    [banana] = httpx.post(cluster.url + "/tokenize", timeout=30, json={
        "prompt": " banana", "add_special_tokens": False}).json()["tokens"]
    out = client.completions.create(model=MODEL, prompt="Paris is", max_tokens=5,
                                    temperature=0, logit_bias={str(banana): 100},
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == " banana" * 5

    def distinct(**penalties: float) -> int:
        answer = client.completions.create(model=MODEL, prompt="one one one one one one",
                                           max_tokens=40, temperature=0, logprobs=0,
                                           extra_body={"ignore_eos": True}, **penalties)
        tokens = answer.choices[0].logprobs.tokens
        assert len(tokens) == 40
        return len(set(tokens))

    plain = distinct()
    assert distinct(frequency_penalty=2.0) > plain and distinct(presence_penalty=2.0) > plain
    wait_no_leaks(cluster)
