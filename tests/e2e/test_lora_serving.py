"""LoRA adapters on real clusters (every shared shape serves ``LORA`` beside SmolLM2): a
request's ``model`` picks the adapter, its answer is the one-process engine's on that
adapter on every shape (disaggregated, pipeline stages, colocated), requests of the base
model and the adapter share steps without changing each other's answers, and a prompt's
KV computed on one never serves the other."""
from __future__ import annotations

import asyncio
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest

from common.engine import Engine, EngineConfig, generate
from common.engine.sampling import SamplingParams
from launch.cluster import LocalCluster
from tests.e2e.conftest import LORA, MODEL, SharedClusters, wait_no_leaks, write_adapter

pytestmark = pytest.mark.e2e
BASE = "smollm2-135m"
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(params=["disaggregated", "pipeline", "colocated"])
def any_shape(request: pytest.FixtureRequest, shared: SharedClusters) -> Iterator[LocalCluster]:
    cluster = shared.get(request.param)
    yield cluster
    wait_no_leaks(cluster)


@pytest.fixture
def cluster(shared: SharedClusters) -> Iterator[LocalCluster]:
    cluster = shared.get("disaggregated")
    yield cluster
    wait_no_leaks(cluster)


@lru_cache(maxsize=1)
def engine(adapter_dir: str) -> Engine:
    """One process serving the same adapter (its files written again: the same bytes)."""
    return Engine(EngineConfig(model=MODEL or BASE, num_blocks=256,
                               lora_modules=((LORA, adapter_dir),)))


def alone(tmp: Path, messages: list[dict], adapter: Optional[str], max_tokens: int) -> str:
    eng = engine(str(write_adapter(tmp / LORA, MODEL or BASE)))
    ids = eng.apply_chat_template(messages)
    return generate(eng, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                             adapter=adapter)).text


def chat(url: str, model: str, messages: list[dict], max_tokens: int, n: int = 1) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "n": n})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_adapter_answers_as_one_process_does(any_shape, tmp_path_factory) -> None:
    """On every shape: the prefill's and decode's processes, a pipeline's two stages (each
    with its layers' share of the adapter), a colocated worker's mixed steps; two choices
    of one prompt (its KV shared) each the same greedy answer."""
    cluster, tmp = any_shape, tmp_path_factory.mktemp("alone")
    out = chat(cluster.url, LORA, QUESTION, 20, n=2)
    assert out["model"] == LORA
    text = out["choices"][0]["message"]["content"]
    assert text == alone(tmp, QUESTION, LORA, 20) == out["choices"][1]["message"]["content"]
    base = chat(cluster.url, BASE, QUESTION, 20)["choices"][0]["message"]["content"]
    assert base == alone(tmp, QUESTION, None, 20) and base != text


def test_models_lists_the_adapter_under_its_base(cluster) -> None:
    cards = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), (LORA, BASE)]
    assert cards[1]["root"].endswith(LORA)


def test_base_and_adapter_requests_side_by_side(cluster) -> None:
    """Six requests at once, alternating the model: each answers as it does alone."""
    questions = [[{"role": "user", "content": f"Write a word that rhymes with {w}."}]
                 for w in ("cat", "tree", "blue")]
    models = [BASE, LORA]
    want = {(m, i): chat(cluster.url, m, q, 12)["choices"][0]["message"]["content"]
            for m in models for i, q in enumerate(questions)}

    async def all_at_once() -> dict:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(m: str, i: int) -> tuple:
                r = await client.post(cluster.url + "/v1/chat/completions", json={
                    "model": m, "messages": questions[i], "max_tokens": 12, "temperature": 0})
                return (m, i), r.json()["choices"][0]["message"]["content"]
            return dict(await asyncio.gather(*(one(m, i) for i in range(3) for m in models)))

    assert asyncio.run(all_at_once()) == want
    metrics = httpx.get(cluster.url + "/metrics", timeout=10).text  # counted by model
    for model in models:
        assert f'crescent_router_requests_total{{endpoint="/v1/chat/completions",' \
               f'model="{model}",status="200"}}' in metrics


def test_a_prompt_cached_on_the_adapter_is_not_read_by_the_base_model(cluster) -> None:
    prompt = f"{uuid.uuid4().hex} " + "Tell me about tides. " * 12  # blocks never seen

    def cached(model: str) -> int:
        r = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(LORA) == 0
    assert cached(LORA) > 0  # its own blocks again
    assert cached(BASE) == 0  # never the adapter's
    assert cached(BASE) > 0


def test_an_unknown_model_names_what_is_served(cluster) -> None:
    r = httpx.post(cluster.url + "/v1/completions", timeout=30,
                   json={"model": "other", "prompt": "hi", "max_tokens": 2})
    assert r.status_code in (400, 404)
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"'{BASE}', '{LORA}'" in error["message"]
