"""The colocated mode: one worker prefills and decodes in the same steps, behind the same
router and conductor. Its greedy outputs equal the engine run alone and the
disaggregated cluster's; aborts and bad input leave no block behind; its new blocks go
to the store."""
from __future__ import annotations

import time
import uuid

import httpx
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import SharedClusters, wait_no_leaks
from tests.e2e.test_serving import PARIS, all_at_once, chunk_text, engine_alone, stream_chat

pytestmark = pytest.mark.e2e

PROMPTS = ["What is the capital of France?", "Name three primary colours.",
           "Write a haiku about the sea.", "What is 12 times 12?",
           "Who wrote Hamlet?", "Describe a cat in one sentence."]


@pytest.fixture(scope="module")
def colocated(shared: SharedClusters) -> LocalCluster:
    return shared.get("colocated")


def test_only_a_colocated_worker_runs(colocated: LocalCluster) -> None:
    roles = sorted(ch.role for ch in colocated.children)
    assert roles == ["colocated", "conductor", "router", "store_master", "store_node"]
    pools = httpx.get(colocated.url + "/debug/pools", timeout=5).json()["instances"]
    assert [p["role"] for p in pools] == ["colocated"]


def test_streamed_answer_equals_engine_alone(colocated: LocalCluster) -> None:
    text = chunk_text(stream_chat(colocated.url, PARIS, 24))
    assert "Paris" in text
    assert text == engine_alone(PARIS, 24)
    wait_no_leaks(colocated)


def test_concurrent_requests_share_steps_and_match_engine_alone(colocated) -> None:
    """Six prompts at once with a 48-token budget: prompts are chunked across steps while
    others decode, and every answer equals the engine's alone."""
    expected = [engine_alone([{"role": "user", "content": p}], 12) for p in PROMPTS]
    assert all_at_once(colocated.url, PROMPTS) == expected
    # The same prompts again hit the local prefix cache and still answer the same.
    assert all_at_once(colocated.url, PROMPTS) == expected
    metrics = httpx.get(colocated.url + "/metrics", timeout=5).text
    assert "crescent_" in metrics
    wait_no_leaks(colocated)


def test_disconnect_and_bad_input_free_every_block(colocated: LocalCluster) -> None:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", colocated.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    r = httpx.post(colocated.url + "/v1/chat/completions", timeout=30, json={
        "model": "smollm2-135m", "messages": [{"role": "user", "content": "hi " * 9000}]})
    assert r.status_code == 400, r.text
    wait_no_leaks(colocated, timeout_s=15)
    assert "Paris" in chunk_text(stream_chat(colocated.url, PARIS, 16))


def test_a_new_prompts_blocks_go_to_the_store(colocated: LocalCluster) -> None:
    """Its full blocks are put in the store after its prefill, as a prefill worker's are
    (layer-wise I/O is the prefill worker's: the colocated worker puts whole blocks)."""
    c = colocated.config
    url = f"http://{c.address('store_master')}:{c.port('store_master_http')}/metrics"

    def objects() -> float:
        line = next(ln for ln in httpx.get(url, timeout=5).text.splitlines()
                    if ln.startswith("store_objects "))
        return float(line.split()[1])

    before = objects()
    prompt = f"{uuid.uuid4()} " + "a story of rivers and bridges, " * 12  # ~100 tokens
    r = httpx.post(colocated.url + "/v1/completions", timeout=60, json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    full_blocks = r.json()["usage"]["prompt_tokens"] // c.block_size
    deadline = time.monotonic() + 15
    while objects() < before + full_blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    assert objects() >= before + full_blocks
