"""The router when the conductor goes silent (fast 503s, recovery without a restart) and
when the router itself gets SIGTERM (new requests 503, the stream in flight finishes)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common.config import ClusterConfig
from common.status_protocol import ClusterStatus
from tests.router.conftest import (CONDUCTOR_TIMEOUT_S, HEARTBEAT_S, REPO,
                                   REQUEST_TIMEOUT_S, _wait_listening)
from tests.router.fake_cluster import READY, FakeCluster, accepted, deltas
from tests.router.http_client import Reply, connect, get, post
from tests.router.test_router_http import eventually

COMPL = "/v1/completions"


def silence(fake: FakeCluster) -> None:
    """Stop the conductor's status and wait until the router calls it lost."""
    fake.status = None
    time.sleep(CONDUCTOR_TIMEOUT_S + 2 * HEARTBEAT_S)


def test_new_request_gets_a_fast_503_while_the_conductor_is_silent(
        router: str, fake: FakeCluster) -> None:
    silence(fake)
    submitted = len(fake.submits())
    start = time.monotonic()
    reply = post(router, COMPL, {"prompt": "x"})
    took = time.monotonic() - start
    assert reply.status == 503, reply.body
    err = reply.json()["error"]
    assert (err["code"], err["type"]) == ("cluster_unavailable", "service_unavailable")
    assert "no word from the conductor for" in err["message"]
    assert reply.headers["retry-after"] == "1"
    assert took < 0.5 and len(fake.submits()) == submitted  # nothing was sent on
    metrics = get(router, "/metrics").body.decode()
    assert f'crescent_router_requests_total{{endpoint="{COMPL}",model="smollm2-135m",' \
        'status="503"}' in metrics


def test_serving_resumes_when_the_conductor_returns(router: str, fake: FakeCluster) -> None:
    silence(fake)
    assert post(router, COMPL, {"prompt": "x"}).status == 503
    fake.status = READY
    reply = eventually(lambda: (r := post(router, COMPL, {"prompt": "x"})).status == 200
                       and r, timeout=3.0)
    assert reply and reply.json()["choices"][0]["text"] == "Hello world!"


def test_waiting_request_fails_within_a_beat_of_the_loss(router: str,
                                                         fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, accepted(req))]  # accepted, then nothing ever again
    out: list[Reply] = []
    thread = threading.Thread(target=lambda: out.append(post(router, COMPL, {"prompt": "x"})))
    start = time.monotonic()
    thread.start()
    time.sleep(0.1)
    fake.status = None
    thread.join(5)
    took = time.monotonic() - start
    assert out and out[0].status == 503, out
    assert out[0].json()["error"]["code"] == "cluster_unavailable"
    assert CONDUCTOR_TIMEOUT_S < took < REQUEST_TIMEOUT_S  # not the 504 of the deadline
    abort = fake.wait_abort(fake.submits()[-1].request_id, timeout=1.0)
    assert abort is not None and abort.reason == "conductor lost"


def test_silent_stream_ends_with_an_error_event(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, accepted(req))] + deltas(req, ["a", "b"])[:1]
    fake.status = None
    reply = post(router, COMPL, {"prompt": "x", "stream": True})
    assert reply.status == 200
    events = reply.events()
    assert events[0]["choices"][0]["text"] == "a"
    assert events[-2]["error"]["code"] == "cluster_unavailable" and events[-1] == "[DONE]"


def test_a_live_stream_outlasts_a_lost_conductor(router: str, fake: FakeCluster) -> None:
    """A decode worker streams without the conductor: tokens keep the request alive."""
    words = [f"w{i} " for i in range(20)]
    fake.script = lambda req: [(0, accepted(req))] + deltas(req, words, delay=0.1)
    fake.status = None
    reply = post(router, COMPL, {"prompt": "x"})  # 2 s of tokens, conductor lost at 0.8 s
    assert reply.status == 200 and reply.json()["choices"][0]["text"] == "".join(words)


# ---------------------------------------------------------------- drain on SIGTERM
def test_sigterm_finishes_the_stream_in_flight_and_refuses_new_work(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"http_port = 20300\nbase_port = 20310\nheartbeat_interval_s = "
                    f"{HEARTBEAT_S}\n[supervise]\ndrain_timeout_s = 5.0\n")
    config = ClusterConfig.load(str(path))
    fake = FakeCluster(config)
    words = [f"w{i} " for i in range(15)]
    fake.script = lambda req: [(0, accepted(req))] + deltas(req, words, delay=0.1)
    fake.start()
    log = tmp_path / "router.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.router", "--config",
                                 str(path)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO)
    url = "http://127.0.0.1:20300"
    try:
        _wait_listening(proc, url, log, timeout=120)
        assert eventually(lambda: get(url, "/health").status == 200)
        conn = connect(url)
        conn.request("POST", COMPL, body=json.dumps({"prompt": "x", "stream": True}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        assert eventually(lambda: get(url, "/health").json() == {
            "status": "unavailable", "reason": "shutting down"}, timeout=2.0)
        refused = post(url, COMPL, {"prompt": "x"})
        assert refused.status == 503 and refused.json()["error"]["code"] == "draining"
        body = resp.read().decode()  # the stream goes on to its end
        assert body.rstrip().endswith("data: [DONE]") and '"finish_reason":"stop"' in body
        assert proc.wait(10) == 0
        assert "SIGTERM: draining" in log.read_text()
        assert "drain: idle after" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        fake.stop()



def test_a_request_orphaned_by_a_conductor_restart_fails_after_the_grace() -> None:
    """Accepted by a conductor that is then replaced faster than the router calls it lost:
    the new one never heard of the request. Once the grace after the new epoch passes
    without any word about it, it fails with a 503; one with news since does not."""
    from services.router.flow import RequestRun
    from services.router.state import RouterState

    config = ClusterConfig(heartbeat_timeout_s=0.5)
    state = RouterState(config, mailbox=None, tokenizer=None, block_keys=None)  # type: ignore
    state._on_status(ClusterStatus(True, [], conductor_epoch=1))
    run = object.__new__(RequestRun)  # the wait logic only; nothing is submitted
    run.state, run._last_word = state, time.monotonic()
    assert run._orphaned() is None and state.restarted_at is None
    time.sleep(0.01)
    state._on_status(ClusterStatus(True, [], conductor_epoch=2))
    assert state.restarted_at is not None and state.orphan_grace_s == 2.0
    assert run._orphaned() is None  # within the grace
    state.restarted_at -= 2.0  # as if the grace had passed ...
    run._last_word -= 2.0  # ... with no word since before the restart
    err = run._orphaned()
    assert err is not None and (err.status, err.code) == (503, "conductor_restarted")
    run._last_word = time.monotonic()  # e.g. the new conductor accepted it after all
    assert run._orphaned() is None
