"""n > 1 and best_of on real clusters: one prefill, n sequences on the decode worker over
the prompt's shared KV blocks (a copy of its last partial block each), every choice
reproducible under a seed; the shared blocks are seen in the decode worker's own pool."""
from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from openai import OpenAI

from launch.cluster import LocalCluster
from tests.e2e.conftest import SHAPES, SharedClusters, wait_no_leaks

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
PROMPT = "Once upon a time, in a small village by the mountains,"


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request: pytest.FixtureRequest, shared: SharedClusters) -> LocalCluster:
    return shared.get(request.param)


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> OpenAI:
    return OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)


def complete(cluster: LocalCluster, **body: Any) -> dict:
    r = httpx.post(cluster.url + "/v1/completions", timeout=120,
                   json={"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_choices_are_identical_and_equal_one_choice(cluster: LocalCluster,
                                                           client: OpenAI) -> None:
    one = client.chat.completions.create(model=cluster.config.model_name, messages=MESSAGES,
                                         temperature=0, max_tokens=12,
                                         extra_body={"ignore_eos": True})
    three = client.chat.completions.create(model=cluster.config.model_name,
                                           messages=MESSAGES, temperature=0, max_tokens=12,
                                           n=3, extra_body={"ignore_eos": True})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert all(c.finish_reason == "length" for c in three.choices)
    assert (three.usage.prompt_tokens, three.usage.completion_tokens) == \
        (one.usage.prompt_tokens, 36)
    wait_no_leaks(cluster)


def test_seeded_choices_are_reproducible_each_with_its_own_seed(
        cluster: LocalCluster) -> None:
    texts = [[c["text"] for c in complete(cluster, n=3, seed=7, temperature=1.0)["choices"]]
             for _ in range(2)]
    assert texts[0] == texts[1]
    assert len(set(texts[0])) > 1  # seeds 7, 8, 9: not one sample three times
    assert complete(cluster, seed=7, temperature=1.0)["choices"][0]["text"] == texts[0][0]
    assert complete(cluster, seed=8, temperature=1.0)["choices"][0]["text"] == texts[0][1]
    wait_no_leaks(cluster)


def test_streamed_choices_interleave_and_each_finishes(cluster: LocalCluster,
                                                       client: OpenAI) -> None:
    whole = client.chat.completions.create(model=cluster.config.model_name,
                                           messages=MESSAGES, max_tokens=10, n=2, seed=3,
                                           extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=cluster.config.model_name,
                                            messages=MESSAGES, max_tokens=10, n=2, seed=3,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text = {0: "", 1: ""}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason is not None:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finish == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 20
    wait_no_leaks(cluster)


def test_best_of_returns_the_likeliest_of_its_samples(cluster: LocalCluster) -> None:
    every = complete(cluster, n=4, seed=11, temperature=1.0, logprobs=0)["choices"]
    score = {c["text"]: sum(c["logprobs"]["token_logprobs"]) for c in every}
    best = complete(cluster, n=1, best_of=4, seed=11, temperature=1.0)
    assert [c["index"] for c in best["choices"]] == [0]
    assert best["choices"][0]["text"] == max(score, key=score.__getitem__)
    assert best["choices"][0]["logprobs"] is None  # ranked by them, not asked to show
    assert best["usage"]["completion_tokens"] == 4 * 12
    two = complete(cluster, n=2, best_of=4, seed=11, temperature=1.0)["choices"]
    assert [c["text"] for c in two] == sorted(score, key=score.__getitem__, reverse=True)[:2]
    wait_no_leaks(cluster)


def test_the_prompts_blocks_are_allocated_once_on_the_decode_worker(
        cluster: LocalCluster) -> None:
    """While an n=3 request decodes, its decode worker's pool holds the prompt's full
    blocks once and each choice's own blocks: fewer than three separate requests would."""
    cfg = cluster.config
    bs, n, max_tokens = cfg.block_size, 3, 40  # reserved up front: seen from the first step
    prompt = httpx.post(cluster.url + "/tokenize", timeout=30,
                        json={"prompt": PROMPT * 3}).json()["count"]
    total = -(-(prompt + max_tokens) // bs)
    shared = prompt // bs
    expected = total + (n - 1) * (total - shared)
    decode_role = "colocated" if cfg.mode == "colocated" else "decode"
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            pools = httpx.get(cluster.url + "/debug/pools", timeout=5).json()["instances"]
            seen.extend(p["used_blocks"] for p in pools if p["role"] == decode_role)
            done.wait(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        complete(cluster, prompt=PROMPT * 3, n=n, max_tokens=max_tokens, temperature=0)
    finally:
        done.set()
        watcher.join()
    assert shared >= 1 and max(seen) == expected < n * total, (max(seen), expected, n * total)
    wait_no_leaks(cluster)


def test_every_choice_follows_the_response_format(cluster: LocalCluster,
                                                  client: OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    out = client.chat.completions.create(
        model=cluster.config.model_name, messages=MESSAGES, n=3, seed=5, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    for choice in out.choices:
        doc = json.loads(choice.message.content)
        assert set(doc) == {"name", "age"} and isinstance(doc["age"], int)
    wait_no_leaks(cluster)
