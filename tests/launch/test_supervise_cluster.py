"""A real cluster under supervision: a SIGKILLed conductor comes back and serving resumes
(workers re-register at once); a decode worker that gets SIGTERM mid-stream finishes the
stream, takes no new work meanwhile (a new request waits for its restart), and exits 0;
a stream that outlasts the grace goes on on its restart, as do the streams of a
SIGKILLed decode worker; requests queued on a SIGKILLed prefill worker, its only one,
finish on its restart."""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
import signal
import time
from typing import Iterator

import httpx
import pytest

from launch import forkserver
from launch.cluster import LocalCluster
from tests.e2e.conftest import assert_one_bootstrap

pytestmark = pytest.mark.e2e

CONFIG = """
http_port = 24300
base_port = 24310
decode_blocks = 256
prefill_blocks = 256
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 2.0
cost_profile = "cpu-smollm2-135m"  # no calibration (tests/e2e/conftest.py)

[store]
enabled = false

[slo]  # restarts under test, not admission: the conductor's decode refit learns how slow
ttft_s = 120.0  # a busy CI box's steps are, and the 0.3 s default TBT SLO then rejected
tbt_s = 30.0  # two of four queued prompts (predicted 301 ms)

[supervise]
backoff_s = 0.2
drain_timeout_s = 30.0

[cpu]
affinity = false  # tests/e2e/conftest.py start_cluster: why
"""
URL = "http://127.0.0.1:24300"


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": "smollm2-135m", "prompt": "The capital of France is",
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def long_body() -> dict:
    """A stream of 120 tokens (seconds here, more than a 1 s drain grace): seeded sampling
    (greedy stops early on this prompt)."""
    return {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 120,
            "temperature": 1.0, "seed": 7, "stream": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("supervised")
    (tmp / "c.toml").write_text(CONFIG)
    c = LocalCluster(str(tmp / "c.toml"), tmp / "logs", forkserver=forkserver.shared())
    try:
        c.start(timeout_s=180)
        assert_one_bootstrap(c)
        yield c
    finally:
        c.stop()


def wait_healthy(cluster: LocalCluster, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        cluster.supervise()
        if cluster.healthy():
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(f"not healthy within {timeout_s} s")


def registrations(cluster: LocalCluster, name: str) -> int:
    return cluster.child("conductor").log_path.read_text().count(f"registered {name} ")


def wait_registered(cluster: LocalCluster, name: str, more_than: int) -> None:
    """Until the conductor registered a new incarnation of ``name`` (a SIGKILLed one stays
    listed until its heartbeats are missed: a request placed there meanwhile fails)."""
    deadline = time.monotonic() + 120
    while registrations(cluster, name) <= more_than:
        assert time.monotonic() < deadline, f"{name} did not register again"
        cluster.supervise()
        time.sleep(0.1)


def test_killed_conductor_is_restarted_and_serving_resumes(cluster: LocalCluster) -> None:
    before = httpx.post(URL + "/v1/completions", json=body(8), timeout=60)
    assert before.status_code == 200
    old = cluster.child("conductor").proc.pid
    cluster.kill("conductor", 0)
    killed = time.monotonic()
    lost = httpx.post(URL + "/v1/completions", json=body(8), timeout=60)
    waited = time.monotonic() - killed  # within a beat of heartbeat_timeout_s, not 600 s
    assert lost.status_code == 503 and lost.json()["error"]["code"] == "cluster_unavailable"
    assert waited < 2.0 + 1.0
    start = time.monotonic()
    fast = httpx.post(URL + "/v1/completions", json=body(8), timeout=60)
    refused = time.monotonic() - start  # now known lost: refused at once
    assert fast.status_code == 503 and fast.headers["retry-after"] == "1"
    child = cluster.wait_restarted("conductor", 0, timeout_s=30)
    assert child.proc.pid != old and cluster.restarts == {("conductor", 0): 1}
    wait_healthy(cluster, 60)
    recovered = time.monotonic() - killed
    after = httpx.post(URL + "/v1/completions", json=body(8), timeout=60)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    log = child.log_path.read_text()
    assert "--- crescent up: restart 1 of conductor-0 (exit code -9)" in log
    assert log.count("registered prefill-0") == 2 and log.count("registered decode-0") == 2
    assert "asking it to register" in log  # the workers learned of it at once
    print(f"conductor SIGKILL: waiting request failed after {waited:.2f} s, a new one in "
          f"{refused * 1000:.0f} ms; healthy again after {recovered:.1f} s")


def test_sigterm_drains_a_decode_worker_mid_stream(cluster: LocalCluster) -> None:
    wait_healthy(cluster, 60)
    decode = cluster.child("decode")
    with httpx.Client(base_url=URL, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=body(48, stream=True)) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.killpg(decode.proc.pid, signal.SIGTERM)
            time.sleep(0.5)  # the draining heartbeat reaches the conductor at once
            # No decode worker takes new work now: a new request waits for one (the
            # restart below), up to worker_wait_s
            waiting = ThreadPoolExecutor(1).submit(
                httpx.post, URL + "/v1/completions", json=body(4), timeout=60)
            rest = [first] + [line for line in lines if line.startswith("data: ")]
    chunks = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]" and not any("error" in c for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and text
    assert decode.proc.wait(30) == 0
    log = decode.log_path.read_text()
    assert "SIGTERM: draining" in log and "drain: idle after" in log
    # supervised, it comes back and serves again
    cluster.wait_restarted("decode", 0, timeout_s=30)
    waited = waiting.result(60)
    assert waited.status_code == 200, waited.text  # served by the restarted worker
    assert text.startswith(waited.json()["choices"][0]["text"])
    wait_healthy(cluster, 120)
    again = httpx.post(URL + "/v1/completions", json=body(48), timeout=120)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == text


def test_a_stream_longer_than_the_grace_goes_on_after_the_restart(
        cluster: LocalCluster) -> None:
    """The drained worker leaves with the stream unfinished: the stream goes on, with no
    error event, on the worker's restart (services/router/resume.py)."""
    cluster.extra_args[("decode", 0)] = ["--set", "supervise.drain_timeout_s=1.0"]
    seen = registrations(cluster, "decode-0")
    cluster.kill("decode", 0)
    decode = cluster.wait_restarted("decode", 0, timeout_s=30)
    wait_registered(cluster, "decode-0", seen)
    wait_healthy(cluster, 120)
    with httpx.Client(base_url=URL, timeout=120) as client:
        with client.stream("POST", "/v1/completions", json=long_body()) as resp:
            assert resp.status_code == 200
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            next(lines)
            os.killpg(decode.proc.pid, signal.SIGTERM)
            reading = ThreadPoolExecutor(1).submit(list, lines)
            assert decode.proc.wait(10) == 0
            cluster.wait_restarted("decode", 0, timeout_s=30)
            rest = reading.result(120)
    chunks = [json.loads(line[6:]) for line in rest if line != "data: [DONE]"]
    assert rest[-1] == "data: [DONE]" and not [c for c in chunks if "error" in c], rest[-3:]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "drain: still busy after 1 s; leaving anyway" in decode.log_path.read_text()
    assert "decode-0 shut down; going on as" in cluster.child("router").log_path.read_text()


def test_requests_queued_on_a_killed_prefill_worker_finish_on_its_restart(
        cluster: LocalCluster) -> None:
    """Its only prefill worker SIGKILLed with prompts queued and running on it: each is
    placed again on the restarted worker (the conductor holds them meanwhile) and answers
    as an undisturbed run does; none fails."""
    wait_healthy(cluster, 60)
    prompts = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * 50
               for i in range(4)]  # ~500 tokens each: the prefill queue holds a few
    bodies = [{"model": "smollm2-135m", "prompt": p, "max_tokens": 6, "temperature": 0}
              for p in prompts]
    with ThreadPoolExecutor(len(bodies)) as pool:
        sent = [pool.submit(httpx.post, URL + "/v1/completions", json=b, timeout=120)
                for b in bodies]
        time.sleep(0.5)  # the first is computing, the others queued behind it
        cluster.kill("prefill", 0)
        cluster.wait_restarted("prefill", 0, timeout_s=30)
        answers = [f.result(120) for f in sent]
    assert [a.status_code for a in answers] == [200] * len(bodies), [a.text for a in answers]
    log = cluster.child("conductor").log_path.read_text()
    assert "re-run on prefill-0" in log
    with ThreadPoolExecutor(len(bodies)) as pool:
        undisturbed = list(pool.map(lambda b: httpx.post(URL + "/v1/completions", json=b,
                                                         timeout=120), bodies))
    assert [a.json()["choices"][0]["text"] for a in answers] == \
        [u.json()["choices"][0]["text"] for u in undisturbed]


def test_streams_of_a_killed_decode_worker_go_on_after_its_restart(
        cluster: LocalCluster) -> None:
    """Its only decode worker SIGKILLed mid-stream: each stream waits for the restart and
    goes on there (services/router/resume.py) with no error event, no token repeated or
    missing: the undisturbed greedy answer."""
    wait_healthy(cluster, 60)
    bodies = [{"model": "smollm2-135m", "prompt": p, "max_tokens": 40, "temperature": 0,
               "ignore_eos": True, "stream": True}
              for p in ("Once upon a time", "The capital of France is", "def fib(n):")]
    want = [httpx.post(URL + "/v1/completions", json={**b, "stream": False},
                       timeout=120).json()["choices"][0]["text"] for b in bodies]
    seen = [0] * len(bodies)

    def stream(i: int) -> list[dict]:
        with httpx.stream("POST", URL + "/v1/completions", json=bodies[i], timeout=120) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
                    seen[i] += 1
            return chunks

    resumed = cluster.child("router").log_path.read_text().count("going on as")
    with ThreadPoolExecutor(len(bodies)) as pool:
        streams = [pool.submit(stream, i) for i in range(len(bodies))]
        deadline = time.monotonic() + 60
        while min(seen) < 3:  # every stream is under way
            assert time.monotonic() < deadline, seen
            time.sleep(0.02)
        cluster.kill("decode", 0)
        cluster.wait_restarted("decode", 0, timeout_s=30)
        got = [s.result(120) for s in streams]
    assert not [c for chunks in got for c in chunks if "error" in c]
    assert ["".join(c["choices"][0]["text"] for c in chunks) for chunks in got] == want
    log = cluster.child("router").log_path.read_text()
    assert log.count("going on as") - resumed == len(bodies), log[-2000:]
