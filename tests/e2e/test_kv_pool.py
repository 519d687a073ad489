"""The global KV pool end to end: a prefix computed on one prefill worker is loaded by
another; a dead store node turns hits into recomputation, never into wrong output."""
from __future__ import annotations

import re
import time
from typing import Callable, Iterator

import httpx
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import SharedClusters, start_cluster, wait_no_leaks

pytestmark = pytest.mark.e2e

# ~400 tokens of shared context, then a short question that differs.
CONTEXT = " ".join(f"Fact {i}: the {w} is kept in room {i * 7 % 31}." for i, w in
                   enumerate(["key", "map", "lamp", "book", "coin", "ring", "cup", "pen"] * 5))


def ask(url: str, question: str) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "system", "content": CONTEXT},
                     {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def metric(cluster: LocalCluster, name: str, role: str = "conductor") -> float:
    c = cluster.config
    text = httpx.get(f"http://{c.address(role)}:{c.port(role + '_http')}/metrics",
                     timeout=5).text
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_metric(cluster: LocalCluster, name: str, done: Callable[[float], bool],
                role: str = "conductor") -> None:
    """Until ``done(value)`` of ``role``'s metric ``name`` (30 s at most)."""
    deadline = time.monotonic() + 30
    while not done(metric(cluster, name, role)):
        assert time.monotonic() < deadline, f"{name} never got there"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Round robin sends consecutive requests to different prefill workers.
    c = start_cluster(tmp_path_factory.mktemp("pool"), http=19410, base=19600, prefill=2,
                      scheduler="round_robin")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def cold(shared: SharedClusters) -> LocalCluster:
    """The reference answers: a cluster without the store (the e2e package's shared one)."""
    return shared.get("disaggregated")


def test_second_worker_loads_prefix_from_pool(two_prefill: LocalCluster,
                                              cold: LocalCluster) -> None:
    a = ask(two_prefill.url, "Where is the lamp?")
    assert a["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    # the put of A's blocks completes after A's handover: B comes once the store holds them
    wait_metric(two_prefill, "crescent_conductor_global_index_keys", lambda n: n >= 20)
    b = ask(two_prefill.url, "Where is the coin?")
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 16 * 20, "B should reuse the shared context from the pool"
    assert metric(two_prefill, "crescent_global_cache_hit_tokens") >= cached
    b_cold = ask(cold.url, "Where is the coin?")
    assert b["choices"][0]["message"]["content"] == b_cold["choices"][0]["message"]["content"]
    wait_no_leaks(two_prefill)


def test_killed_store_node_means_recompute_not_errors(two_prefill: LocalCluster,
                                                      cold: LocalCluster) -> None:
    want = ask(cold.url, "Where is the ring?")["choices"][0]["message"]["content"]
    two_prefill.kill("store_node", 0)
    for _ in range(4):  # across both prefill workers, before and after the master notices
        got = ask(two_prefill.url, "Where is the ring?")
        assert got["choices"][0]["message"]["content"] == want
    wait_metric(two_prefill, "store_nodes", lambda n: n == 0, "store_master")  # noticed
    got = ask(two_prefill.url, "Where is the book? Answer briefly.")
    assert got["choices"][0]["finish_reason"] in ("stop", "length")
    wait_no_leaks(two_prefill)
