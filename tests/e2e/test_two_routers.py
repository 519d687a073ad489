"""Two routers behind one port (``routers = 2``): the kernel spreads the connections, each
router answers the requests it took (its answers and the decode worker's tokens come to
its own inbox), and the cluster's status reaches both. Greedy answers are the same through
either router."""
from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Iterator

import httpx
import pytest

from launch.cluster import LocalCluster
from services.router.app import own_metrics_port
from tests.e2e.conftest import start_cluster, wait_no_leaks

pytestmark = pytest.mark.e2e

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("routers"), http=23700, base=23710,
                      store=False, extra="routers = 2\nmetrics_port = 23760\n")
    try:
        yield c
    finally:
        c.stop()


async def ask(url: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(the router that answered, the answer), on a connection of its own."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 6, "temperature": 0, "stream": stream}
    async with httpx.AsyncClient(timeout=120) as client:
        if not stream:
            r = await client.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return r.headers["x-crescent-router"], r.json()["choices"][0]["message"]["content"]
        text = ""
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
            return r.headers["x-crescent-router"], text


def test_both_routers_serve_and_answer_alike(cluster: LocalCluster) -> None:
    async def burst() -> list[tuple[str, str]]:
        return await asyncio.gather(*(ask(cluster.url, "Name a colour.", i % 2 == 0)
                                      for i in range(16)))

    answers = asyncio.run(burst())
    routers = Counter(r for r, _ in answers)
    assert set(routers) == {"router-0", "router-1"}, routers  # 16 connections: both
    assert len({text for _, text in answers}) == 1, answers  # greedy: one answer
    assert answers[0][1]
    wait_no_leaks(cluster)
    # each router's own /metrics (its slot of metrics_port + n) counts what it served
    for i in (0, 1):
        text = httpx.get(f"http://127.0.0.1:{own_metrics_port(cluster.config, i)}/metrics",
                         timeout=5).text
        served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("crescent_router_requests_total{"))
        assert served == routers[f"router-{i}"], (i, routers, text[:500])
    # the dashboard's request log, from either router, is both routers' (each request
    # named by the router that took it); its rates are the answering router's
    r = httpx.get(cluster.url + "/debug/dashboard", timeout=10)
    d = r.json()
    assert (d["router"], d["routers"], d["routers_silent"]) == (
        r.headers["x-crescent-router"], 2, [])
    assert Counter(q["router"] for q in d["requests"]) == routers, d["requests"]

