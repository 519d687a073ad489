"""One cluster over three hosts (network namespaces on one machine, tests/multihost/
conftest.py): it answers exactly as one host does, its KV crosses hosts through the
transfer engine and never through shared memory (which one host uses), the OpenAI API's
features (streaming, n choices, structured outputs, errors) work across hosts, a prefix
computed on one host is served to another from the store, and a decode worker SIGKILLed
under load loses nothing and comes back."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from benchmarks.fault_load import body, reference_answers
from benchmarks.faults import Timing, run_fault
from launch.multihost import NetnsCluster
from tests.multihost.conftest import (
    MAX_TOKENS, QUESTIONS, call, conductor_metrics, kv_bytes, wait_metrics,
)

pytestmark = pytest.mark.e2e
MODEL = "smollm2-135m"


def test_processes_run_on_their_hosts(multihost: NetnsCluster) -> None:
    placed = {c.name: multihost.host(c.role, c.index) for c in multihost.children}
    assert placed == {"store_master-0": "h1", "store_node-0": "h2", "store_node-1": "h3",
                      "conductor-0": "h1", "prefill-0": "h2", "prefill-1": "h1",
                      "decode-0": "h3", "router-0": "h1", "router-1": "h3"}
    for child in multihost.children:
        assert child.proc.args[:4] == ["ip", "netns", "exec", f"cmhe-{placed[child.name]}"]
        assert child.proc.args[5:8] == ["-m", "launch.cli", "serve"]  # crescent serve ROLE


def test_greedy_answers_match_a_single_host_cluster(multihost: NetnsCluster,
                                                    single_host: dict) -> None:
    answers = multihost.call(reference_answers, multihost.url, QUESTIONS, MAX_TOKENS)
    assert answers == single_host["answers"]
    assert all(answers)


def test_a_second_router_on_another_host_answers_the_same(multihost: NetnsCluster,
                                                          single_host: dict) -> None:
    """Router 1 on h3 (``[hosts] router`` lists one address per router): its clients get
    the same greedy answers, the conductor's replies and the decode worker's tokens
    reaching it at its own host."""
    url = f"http://{multihost.config.address('router', 1)}:{multihost.config.http_port}"
    assert multihost.host("router", 1) == "h3" and url != multihost.url
    answers = multihost.bed.call("h3", reference_answers, url, QUESTIONS[:2], MAX_TOKENS)
    assert answers == single_host["answers"][:2]
    r = multihost.bed.call("h3", httpx.get, url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.headers["X-Crescent-Router"] == "router-1"
    # its dashboard's request log holds router 0's requests too, asked across hosts
    multihost.call(reference_answers, multihost.url, QUESTIONS[:1], MAX_TOKENS)
    d = multihost.bed.call("h3", httpx.get, url + "/debug/dashboard", timeout=10).json()
    assert d["routers_silent"] == [] and {q["router"] for q in d["requests"]} == {
        "router-0", "router-1"}, d["requests"]


def test_kv_crosses_hosts_through_the_transfer_engine(multihost: NetnsCluster,
                                                      single_host: dict) -> None:
    # One host: prefill → decode KV goes through shared memory only.
    one = single_host["kv_bytes"]
    assert one[("prefill-0", "decode", "shm")] > 0
    assert one.get(("prefill-0", "decode", "transfer_engine"), 0) == 0
    # Three hosts (both prefill workers are on other hosts than decode): transfer engine
    # only, although the decode worker's /dev/shm file is visible to them here.
    text = wait_metrics(multihost, lambda t: all(
        (f"prefill-{i}", "decode", "transfer_engine") in kv_bytes(t) for i in (0, 1)))
    many = kv_bytes(text)
    for i in (0, 1):
        assert many[(f"prefill-{i}", "decode", "transfer_engine")] > 0
        assert many.get((f"prefill-{i}", "decode", "shm"), 0) == 0


def _api_across_hosts(url: str) -> None:
    """The official client against a router whose prefill and decode workers are on other
    hosts (run inside the router's host)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    whole = client.chat.completions.create(model=MODEL, messages=messages,
                                           max_tokens=MAX_TOKENS, temperature=0)
    streamed = client.chat.completions.create(model=MODEL, messages=messages,
                                              max_tokens=MAX_TOKENS, temperature=0,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == whole.choices[0].message.content and text

    two = client.chat.completions.create(model=MODEL, messages=messages, n=2, seed=3,
                                         max_tokens=MAX_TOKENS, temperature=1.0)
    assert sorted(c.index for c in two.choices) == [0, 1]
    alone = [client.chat.completions.create(model=MODEL, messages=messages, seed=3 + i,
                                            max_tokens=MAX_TOKENS, temperature=1.0)
             for i in (0, 1)]  # choice i samples as seed + i asked alone
    assert [c.message.content for c in sorted(two.choices, key=lambda c: c.index)] == [
        a.choices[0].message.content for a in alone]
    assert two.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    shaped = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    reply = json.loads(shaped.choices[0].message.content)
    assert list(reply) == ["city"] and isinstance(reply["city"], str)

    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=messages, temperature=5)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "temperature"


def test_the_openai_api_works_across_hosts(multihost: NetnsCluster) -> None:
    multihost.call(_api_across_hosts, multihost.url)
    # no prefill worker shares a host with the decode worker: KV crossed hosts only
    def to_decode(text: str, path: str) -> float:
        return sum(n for (_, flow, via), n in kv_bytes(text).items()
                   if flow == "decode" and via == path)
    text = wait_metrics(multihost, lambda t: to_decode(t, "transfer_engine") > 0)
    assert to_decode(text, "shm") == 0


def _ask(cluster: NetnsCluster, prompt: str) -> dict:
    r = cluster.call(httpx.post, cluster.url + "/v1/chat/completions",
                     json=body(prompt, 4, False), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _served_by(cluster: NetnsCluster, before: dict) -> str:
    """The prefill worker whose KV-to-decode bytes grew since ``before``."""
    grown: list[str] = []

    def one_grew(text: str) -> bool:
        grown[:] = [key[0] for key, n in kv_bytes(text).items()
                    if key[1] == "decode" and n > before.get(key, 0)]
        return len(grown) == 1

    wait_metrics(cluster, one_grew)
    return grown[0]


def test_a_prefix_computed_on_one_host_is_loaded_on_another_from_the_store(
        multihost: NetnsCluster) -> None:
    # Round-robin placement: the same long prompt twice in a row goes to both prefill
    # workers. Arrange that prefill-0 (h2) computes it, so prefill-1 (h1, no store node)
    # must load it from a node on h2 or h3.
    story = ("In the harbour town the lighthouse keeper wrote down every ship that passed, "
             "its flag, its cargo and the hour. ") * 8
    for attempt in range(2):
        prompt = f"Log {attempt}: {story} Which ship came first?"
        before = kv_bytes(call(multihost, conductor_metrics, multihost))
        first = _ask(multihost, prompt)
        if _served_by(multihost, before) == "prefill-0":
            break
    else:
        pytest.fail("round-robin never placed a fresh prompt on prefill-0")
    time.sleep(0.5)  # the store puts of the first run complete after its answer
    before = kv_bytes(call(multihost, conductor_metrics, multihost))
    second = _ask(multihost, prompt)
    assert _served_by(multihost, before) == "prefill-1"
    assert second["choices"][0]["message"]["content"] == \
        first["choices"][0]["message"]["content"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    text = wait_metrics(multihost, lambda t: kv_bytes(t).get(
        ("prefill-1", "store_read", "transfer_engine"), 0) > before.get(
        ("prefill-1", "store_read", "transfer_engine"), 0))
    assert kv_bytes(text).get(("prefill-1", "store_read", "shm"), 0) == 0


def test_decode_sigkill_under_load_loses_nothing_and_restarts(multihost: NetnsCluster,
                                                              single_host: dict) -> None:
    multihost.supervise_in_background()
    result = multihost.call(asyncio.run, run_fault(
        multihost, "decode", QUESTIONS, single_host["answers"],
        Timing(warm=1.5, phase=2.0, recover=60.0, idle=20.0), 3, MAX_TOKENS))
    assert multihost.failure is None
    assert (result.lost, result.wrong, result.leaked, result.unclear) == (0, 0, 0, 0), result
    assert result.missing == 0 and result.orphans == 0, result
    assert result.recovery_s is not None and result.completed > 0, result
    assert multihost.restarts.get(("decode", 0)) == 1
    assert multihost.host("decode", 0) == "h3"  # restarted where it was
    assert multihost.child("decode", 0).proc.args[3] == "cmhe-h3"
