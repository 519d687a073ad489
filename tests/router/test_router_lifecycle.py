"""Client disconnects, readiness, pool introspection, metrics, and the official client."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import openai

from common.status_protocol import ClusterStatus, InstanceStatus
from tests.router.fake_cluster import FakeCluster, accepted, deltas
from tests.router.http_client import connect, get, post
from tests.router.test_router_http import MODEL, USER, eventually

SLOW = [f"w{i} " for i in range(40)]


def slow_script(req):  # type: ignore[no-untyped-def]
    return [(0, accepted(req))] + deltas(req, SLOW, delay=0.1)


def test_stream_disconnect_aborts(router: str, fake: FakeCluster) -> None:
    fake.script = slow_script
    conn = connect(router)
    conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"messages": USER, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    request_id = json.loads(first[len(b"data: "):])["id"]
    resp.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    abort = fake.wait_abort(request_id, timeout=3.0)
    assert abort is not None and abort.reason == "client disconnected"


def test_non_stream_disconnect_aborts(router: str, fake: FakeCluster) -> None:
    fake.script = slow_script
    conn = connect(router, timeout=0.4)
    conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                 body=json.dumps({"prompt": "x"}))
    try:
        conn.getresponse()
        raise AssertionError("the response should not have come yet")
    except socket.timeout:
        pass
    conn.close()
    request_id = fake.submits()[-1].request_id
    abort = fake.wait_abort(request_id, timeout=3.0)
    assert abort is not None and abort.reason == "client disconnected"


def test_finished_request_sends_no_abort(router: str, fake: FakeCluster) -> None:
    post(router, "/v1/completions", {"prompt": "x"})
    assert fake.wait_abort(fake.submits()[-1].request_id, timeout=0.3) is None


def test_health_follows_cluster_status(router: str, fake: FakeCluster) -> None:
    fake.status = None
    assert eventually(lambda: get(router, "/health").status == 503)
    fake.status = ClusterStatus(False, [])
    reply = eventually(lambda: (r := get(router, "/health")).json().get("reason")
                       == "cluster not ready" and r)
    assert reply.status == 503
    fake.status = ClusterStatus(True, [])
    assert eventually(lambda: get(router, "/health").status == 200)
    assert get(router, "/health").json() == {"status": "ok"}
    fake.status = None  # the conductor goes silent: status turns stale within 3 beats
    started = time.monotonic()
    assert eventually(lambda: get(router, "/health").status == 503, timeout=3.0)
    assert time.monotonic() - started < 2.0
    assert "stale" in get(router, "/health").json()["reason"]


def test_debug_pools(router: str, fake: FakeCluster) -> None:
    instance = InstanceStatus(instance_id="decode-0", role="decode", free_blocks=90,
                              used_blocks=10, total_blocks=100, queued=0, running=1, assigned=1)
    fake.status = ClusterStatus(True, [instance])
    expected = [{"instance_id": "decode-0", "role": "decode", "total_blocks": 100,
                 "free_blocks": 90, "used_blocks": 10, "queued": 0, "running": 1, "assigned": 1,
                 "queued_tokens": 0, "context_tokens": 0, "cached_blocks": 0, "draining": False,
                 "heartbeat_age_s": 0.0}]
    assert eventually(lambda: get(router, "/debug/pools").json()["instances"] == expected)
    assert get(router, "/debug/pools").json()["ready"] is True


def test_metrics(router: str) -> None:
    post(router, "/v1/chat/completions", {"messages": USER})
    text = get(router, "/metrics").body.decode()
    for name in ("crescent_router_requests_total", "crescent_router_requests_in_flight",
                 "crescent_router_time_to_first_token_seconds_bucket",
                 "crescent_router_inter_token_latency_seconds_bucket",
                 "crescent_router_queue_time_seconds_bucket",
                 "crescent_router_e2e_latency_seconds_bucket",
                 "crescent_router_generation_tokens_total",
                 "crescent_router_cached_prompt_tokens_total"):
        assert name in text, name
    assert 'crescent_router_requests_total{endpoint="/v1/chat/completions",' \
        'model="smollm2-135m",status="200"}' in text


def test_a_rerun_accepted_again_counts_its_queue_time_once(router: str,
                                                          fake: FakeCluster) -> None:
    """The conductor says accepted at each reservation, a re-run's too: one request
    waited in the queue once."""
    def queued() -> float:
        text = get(router, "/metrics").body.decode()
        return float(next(line.split()[-1] for line in text.splitlines()
                          if line.startswith("crescent_router_queue_time_seconds_count")))

    before = queued()
    fake.script = lambda req: [(0, accepted(req)), (0, accepted(req))] + deltas(req, ["a"])
    assert post(router, "/v1/completions", {"prompt": "x"}).json()["choices"][0]["text"] == "a"
    assert queued() == before + 1


def test_official_openai_client(router: str, fake: FakeCluster) -> None:
    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8)
    assert reply.choices[0].message.content == "Hello world!"
    assert reply.usage.prompt_tokens == len(fake.submits()[-1].token_ids)
    assert reply.usage.prompt_tokens_details.cached_tokens == 16
    stream = client.chat.completions.create(model=MODEL, messages=USER, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world!"
    assert chunks[-1].usage.completion_tokens == 3
    completion = client.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    assert completion.choices[0].text == "Hello world!"
    try:
        client.chat.completions.create(model="nope", messages=USER)
        raise AssertionError("expected a 400")
    except openai.BadRequestError as exc:
        assert exc.code == "model_not_found"


def test_concurrent_requests_do_not_mix(router: str, fake: FakeCluster) -> None:
    from concurrent.futures import ThreadPoolExecutor

    fake.script = lambda req: [(0, accepted(req))] + deltas(
        req, [req.request_id[:8], req.request_id[8:]], delay=0.02)

    def one(i: int) -> tuple[str, str]:
        body = post(router, "/v1/completions", {"prompt": f"p{i}"}).json()
        return body["id"], body["choices"][0]["text"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    assert all(rid == text for rid, text in results)
    assert len({rid for rid, _ in results}) == 48
    assert 'crescent_router_requests_in_flight 0.0' in get(router, "/metrics").body.decode()


def test_the_router_starts_without_torch_or_xgrammar() -> None:
    """The router tokenizes and validates; it never runs a model. Importing it must not
    pull torch, transformers or xgrammar (about 4 s of CPU at every cluster's start);
    xgrammar comes with the first response_format it checks."""
    code = ("import sys, services.router.app; "
            "print(sorted(m for m in ('torch', 'transformers', 'xgrammar') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "[]"


def test_xgrammar_loads_on_a_thread_while_the_loop_serves() -> None:
    """A router's first request that may carry a grammar awaits xgrammar's import
    (``xgrammar_loaded``) on a thread: the loop keeps ticking meanwhile (a stalled router
    loop misses heartbeats and answers 503s). Torch's C extension holds the GIL for about
    0.5 s of the ~2 s import, once; an import on the loop would stall it for all of it."""
    code = """
import asyncio, sys, time
from common.grammar import xgrammar_loaded

async def main():
    ticks = [time.monotonic()]
    async def tick():
        while True:
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())
    ticking = asyncio.create_task(tick())
    before = 'xgrammar' in sys.modules
    await xgrammar_loaded()
    ticking.cancel()
    print(before, 'xgrammar' in sys.modules, round(time.monotonic() - ticks[0], 2),
          round(max(b - a for a, b in zip(ticks, ticks[1:])), 3))

asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    assert out[:2] == ["False", "True"], out
    assert float(out[2]) > 0.5, out  # the import took a while ...
    assert float(out[3]) < float(out[2]) / 2, out  # ... and the loop ticked through it
