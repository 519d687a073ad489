"""top_logprobs on real clusters: the k most likely tokens at every position, computed on
the worker that samples (the prefill worker, or a pipeline group's last stage, for the
first token; the decode worker after; a colocated worker for both), equal to a reference
log-softmax over the model's logits computed here by the engine alone."""
from __future__ import annotations

from typing import Iterator

import httpx
import pytest
import torch

from common.engine import Engine, EngineConfig
from launch.cluster import LocalCluster
from tests.e2e.conftest import SHAPES, SharedClusters, wait_no_leaks

pytestmark = pytest.mark.e2e

K, TOKENS, ATOL = 5, 6, 2e-3
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(EngineConfig(num_blocks=64))


@pytest.fixture(scope="module", params=list(SHAPES))
def cluster(request: pytest.FixtureRequest, shared: SharedClusters) -> LocalCluster:
    return shared.get(request.param)


def reference(engine: Engine, ids: list[int]) -> tuple[list[int], list[float]]:
    """The engine's own top-K (ids, logprobs) after ``ids``: log_softmax of its logits."""
    blocks = engine.pool.allocate(engine.blocks_needed(len(ids)))
    try:
        logits = engine.prefill(ids, blocks)
    finally:
        engine.pool.free(blocks)
    best = torch.topk(torch.log_softmax(logits.float(), -1), K)
    return best.indices.tolist(), best.values.tolist()


def assert_alternatives(got: list[tuple[str, float]], ids: list[int], lps: list[float],
                        engine: Engine) -> None:
    """Same logprobs within ATOL, best first; the same tokens unless two are that close."""
    assert [lp for _, lp in got] == pytest.approx(lps, abs=ATOL)
    for (text, lp), (want, want_lp) in zip(got, zip(ids, lps)):
        if text != engine.decode_tokens([want]):
            assert any(abs(lp - other) <= ATOL for other in lps if other != want_lp), text


def test_chat_top_logprobs_equal_the_reference(cluster: LocalCluster, engine: Engine) -> None:
    url = cluster.url
    prompt = httpx.post(url + "/tokenize", timeout=30, json={
        "messages": MESSAGES, "add_generation_prompt": True}).json()["tokens"]
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0, "logprobs": True,
        "top_logprobs": K, "ignore_eos": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == TOKENS
    ids = list(prompt)
    for entry in content:
        want_ids, want_lps = reference(engine, ids)
        assert entry["token"] == engine.decode_tokens([want_ids[0]])  # greedy: the best
        assert entry["logprob"] == pytest.approx(want_lps[0], abs=ATOL)
        top = entry["top_logprobs"]
        assert all(t["bytes"] == list(t["token"].encode()) for t in top)
        assert_alternatives([(t["token"], t["logprob"]) for t in top], want_ids, want_lps,
                            engine)
        ids.append(want_ids[0])
    wait_no_leaks(cluster)


def test_completions_logprobs_k_streamed(cluster: LocalCluster, engine: Engine) -> None:
    """The completions API's ``logprobs: 3``, streamed: per position a text → logprob map."""
    prompt = engine.tokenizer.encode("The capital of France is")
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 3,
            "stream": True, "ignore_eos": True}
    positions: list[dict[str, float]] = []
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = httpx.Response(200, content=line[6:]).json()["choices"][0]["logprobs"]
                if lp is not None:
                    positions += lp["top_logprobs"]
    assert len(positions) == TOKENS
    ids = list(prompt)
    for top in positions:
        want_ids, want_lps = reference(engine, ids)
        assert len(top) <= 3 and max(top.values()) == pytest.approx(want_lps[0], abs=ATOL)
        for text, lp in top.items():
            assert any(abs(lp - w) <= ATOL for w in want_lps[:4]), (text, lp, want_lps)
        ids.append(want_ids[0])
    wait_no_leaks(cluster)
