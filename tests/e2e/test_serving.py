"""The whole system, started by the launcher, serving the real model (the e2e package's
shared disaggregated cluster)."""
from __future__ import annotations

import asyncio
import json
from functools import lru_cache
from typing import Any, Iterator

import httpx
import pytest

from common.engine import Engine, EngineConfig, generate
from common.engine.sampling import SamplingParams
from launch.cluster import LocalCluster
from common.timeline import STAGES
from tests.e2e.conftest import LORA, SharedClusters, timeline_of, wait_no_leaks

pytestmark = pytest.mark.e2e
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster(shared: SharedClusters) -> LocalCluster:
    return shared.get("disaggregated")


@pytest.fixture
def no_leaks(cluster: LocalCluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


@lru_cache(maxsize=1)
def engine() -> Engine:
    return Engine(EngineConfig(num_blocks=256))


def engine_alone(messages: list[dict], max_tokens: int) -> str:
    """What the engine produces in one process, greedy: the reference for disaggregation."""
    eng = engine()
    ids = eng.apply_chat_template(messages)
    return generate(eng, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)).text


def stream_chat(url: str, messages: list[dict], max_tokens: int) -> list[dict]:
    body = {"model": "smollm2-135m", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        chunks.append(json.loads(ln[len("data: "):]))
    return chunks


def chunk_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_streamed_answer_is_paris_and_equals_engine_alone(cluster, no_leaks) -> None:
    chunks = stream_chat(cluster.url, PARIS, 24)
    text = chunk_text(chunks)
    assert "Paris" in text
    assert len([c for c in chunks if c["choices"]]) >= 3
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    assert text == engine_alone(PARIS, 24)


def test_openai_client_stream_and_not(cluster, no_leaks) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    out = client.chat.completions.create(model="smollm2-135m", messages=PARIS, max_tokens=16,
                                         temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0
    stream = client.chat.completions.create(model="smollm2-135m", messages=PARIS,
                                            max_tokens=16, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m", LORA]  # and its LoRA adapter


def test_completions_endpoint(cluster, no_leaks) -> None:
    r = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
        "model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]


PROMPTS = [f"Count from {i} to {i + 5}." for i in range(4)] + \
          [f"Name a color that starts with the letter {c}." for c in "ABCD"]


def greedy_body(prompt: str, max_tokens: int = 12) -> dict:
    return {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}


def answer(r: httpx.Response, logprobs: bool = False) -> Any:
    """A 200's answer; with ``logprobs`` (asked), (answer, its tokens' logprobs)."""
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    return (text, [t["logprob"] for t in choice["logprobs"]["content"]]) if logprobs else text


def all_at_once(url: str, prompts: list[str], logprobs: bool = False) -> list[Any]:
    """Every prompt sent at the same moment; the answers (``answer``), in prompt order."""
    async def go() -> list[Any]:
        async with httpx.AsyncClient(base_url=url, timeout=180) as client:
            rs = await asyncio.gather(*(client.post(
                "/v1/chat/completions", json=dict(greedy_body(p), logprobs=logprobs))
                for p in prompts))
        return [answer(r, logprobs) for r in rs]

    return asyncio.run(go())


def test_concurrent_requests_match_sequential(cluster, no_leaks) -> None:
    """Greedy answers do not depend on the load (batch_invariant, the default): each
    prompt's tokens and their logprobs, bit for bit, are the same alone as among the
    others sent at once (their 312 prompt tokens take two 256-token prefill steps, which
    split prompts where the load puts them)."""
    with httpx.Client(base_url=cluster.url, timeout=120) as client:
        sequential = [answer(client.post("/v1/chat/completions",
                                         json=dict(greedy_body(p), logprobs=True)), True)
                      for p in PROMPTS]
    assert all_at_once(cluster.url, PROMPTS, logprobs=True) == sequential


@pytest.mark.parametrize("payload, param", [
    (b"{not json", None),
    (b'{"model": "smollm2-135m"}', "messages"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": -1}', "max_tokens"),
    (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "n": 17}', "n"),
])
def test_bad_input_is_400_and_cluster_keeps_serving(cluster, no_leaks, payload, param) -> None:
    r = httpx.post(cluster.url + "/v1/chat/completions", content=payload, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    ok = httpx.post(cluster.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "messages": PARIS, "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200


def test_prompt_longer_than_context_is_400(cluster, no_leaks) -> None:
    long_text = "hello " * 9000
    r = httpx.post(cluster.url + "/v1/chat/completions", timeout=60, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": long_text}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_client_disconnect_aborts_and_frees_blocks(cluster) -> None:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True, "stream_options": {}}
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break  # leave mid-stream; closing the connection must abort the request
    pools = wait_no_leaks(cluster, timeout_s=15)
    assert all(p["used_blocks"] == 0 for p in pools)
    metrics = httpx.get(cluster.url + "/metrics", timeout=5).text
    assert "crescent_" in metrics


def test_seeded_sampling_repeats_and_logprobs_come_back(cluster, no_leaks) -> None:
    def ask(seed: int) -> dict:
        r = httpx.post(cluster.url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2-135m", "messages": PARIS, "max_tokens": 12, "temperature": 1.0,
            "top_p": 0.9, "seed": seed, "logprobs": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    a, b = ask(7), ask(7)
    assert a["message"]["content"] == b["message"]["content"]
    lps = a["logprobs"]["content"]
    assert lps and all(x["logprob"] <= 0.0 for x in lps)
    outs = {ask(s)["message"]["content"] for s in (1, 2, 3, 4)}
    assert len(outs) > 1, "different seeds should not all give the same sample"


def test_every_stage_of_a_request_is_timed_in_order(cluster, no_leaks) -> None:
    """common/timeline.py on (the shared clusters): a streamed request passed every stage,
    each after the one before though they were timed in four processes; the prompt's
    length and first step are in the details (benchmarks/timeline.py reads them)."""
    body = {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    first = json.loads(lines[0][6:])
    t = timeline_of(cluster, first["id"])
    assert set(t.at) == set(STAGES)
    times = [t.at[stage] for stage in STAGES]
    assert times == sorted(times), t.at
    tokens = t.number("router_sent")
    assert tokens is not None and tokens > 3
    assert t.number("step") == tokens and t.number("admitted") == 0  # one chunk, cold
    assert 0 < t.compute_s < t.total_s
