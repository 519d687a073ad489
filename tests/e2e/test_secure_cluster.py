"""A real cluster with the control plane closed: CURVE on every ZeroMQ socket and API keys
on the router (docs/security.md). It serves keyed clients exactly as an open one does
(the store's global cache included); a client without the key gets 401, and a ZeroMQ peer
without the cluster key cannot register a worker."""
from __future__ import annotations

import asyncio
import time
from typing import Iterator

import httpx
import openai
import pytest
import zmq
import zmq.asyncio

from common.config import ClusterConfig
from common.ipc import encode
from common.protocol import RegisterWorker
from common.security import generate_keys
from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-closed"
HTTP, BASE = 20281, 20250  # this file's ports (the 20200-20299 range)
BODY = dict(model="smollm2-135m", temperature=0, max_tokens=12,
            messages=[{"role": "user", "content": "What is the capital of France?"}])


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("closed")
    generate_keys(str(tmp / "keys"))
    extra = f'[security]\ncurve_key_dir = "{tmp / "keys"}"\napi_keys = ["{KEY}"]\n'
    cluster = start_cluster(tmp, http=HTTP, base=BASE, extra=extra)
    yield cluster
    cluster.stop()


def test_keyed_clients_are_served_and_others_refused(closed: LocalCluster) -> None:
    for child in closed.children:
        assert "CURVE on: every ZeroMQ peer must hold the cluster key" in \
            child.log_path.read_text(errors="replace"), child.name
    client = openai.OpenAI(base_url=closed.url + "/v1", api_key=KEY, max_retries=0)
    first = client.chat.completions.create(**BODY)
    again = client.chat.completions.create(**BODY)
    assert "Paris" in first.choices[0].message.content
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix was reused
    stranger = openai.OpenAI(base_url=closed.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(**BODY)
    assert httpx.get(closed.url + "/debug/pools", timeout=5).status_code == 401
    # the store master's KV events reach the conductor's global index (PUB/SUB and the
    # snapshot DEALER are CURVE sockets too)
    metrics = f"http://127.0.0.1:{ClusterConfig(base_port=BASE).port('conductor_http')}/metrics"
    deadline = time.monotonic() + 10
    while global_index_keys(httpx.get(metrics, timeout=5).text) == 0:
        assert time.monotonic() < deadline, "no store event reached the conductor"
        time.sleep(0.2)


def global_index_keys(metrics: str) -> float:
    line = next(x for x in metrics.splitlines()
                if x.startswith("crescent_conductor_global_index_keys "))
    return float(line.split()[1])


def test_a_worker_without_the_cluster_key_cannot_register(closed: LocalCluster) -> None:
    conductor = ClusterConfig(base_port=BASE).inbox("conductor")

    async def push() -> None:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.connect(conductor)
        try:
            await asyncio.wait_for(sock.send(encode(RegisterWorker(
                "prefill-9", "prefill", "tcp://127.0.0.1:1", "127.0.0.1:1", 0, 1024, 512,
                8, 16))), 1.0)
        except asyncio.TimeoutError:
            pass  # refused at the handshake: no pipe to queue on
        finally:
            sock.close()
            ctx.term()

    asyncio.run(push())
    time.sleep(1.0)  # several heartbeats of the conductor's ClusterStatus
    pools = httpx.get(closed.url + "/debug/pools", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=5).json()["instances"]
    assert sorted(p["instance_id"] for p in pools) == ["decode-0", "prefill-0"]
    log = closed.child("conductor").log_path.read_text(errors="replace")
    assert f"{conductor}: dropped a ZeroMQ peer" in log
