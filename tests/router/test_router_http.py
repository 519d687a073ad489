"""The router over real sockets: HTTP in front, a scripted conductor behind its mailbox."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import pytest

from common.protocol import RequestFailed, RequestRejected, SubmitRequest, TokenDeltas
from common.sampling_params import SamplingParams
from common.scheduling import Rejection
from common.kv.block_keys import compute_block_keys, model_fingerprint
from services.router.tokenizer import load_model_meta
from tests.router.fake_cluster import WORDS, FakeCluster, accepted, deltas
from tests.router.http_client import get, post

MODEL = "smollm2-135m"
CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
USER = [{"role": "user", "content": "Say hello"}]


def eventually(check: Callable[[], Any], timeout: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def choices(events: list) -> list:
    return [e["choices"] for e in events if isinstance(e, dict)]


def usage(prompt: int, completion: int = 3, cached: int = 16) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def test_models(router: str) -> None:
    body = get(router, "/v1/models").json()
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["object"] == "list" and body["data"][0]["object"] == "model"


def test_a_decode_steps_deltas_in_one_message(router: str, fake: FakeCluster) -> None:
    """A decode worker sends a step's deltas as one TokenDeltas (services/decode/outbox.py):
    the router streams each to its request as if they came one by one."""
    fake.script = lambda req: [(0.0, accepted(req)),
                               (0.0, TokenDeltas([d for _, d in deltas(req, WORDS)]))]
    reply = post(router, CHAT, {"model": MODEL, "messages": USER})
    assert reply.status == 200
    assert reply.json()["choices"][0]["message"]["content"] == "".join(WORDS)


def test_chat_stream_exact_chunks_with_usage(router: str, fake: FakeCluster) -> None:
    reply = post(router, CHAT, {"model": MODEL, "messages": USER, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = reply.events()
    assert events[-1] == "[DONE]"
    n_prompt = len(fake.submits()[-1].token_ids)
    none = {"logprobs": None, "finish_reason": None, "index": 0}
    assert choices(events) == [
        [dict(none, delta={"role": "assistant", "content": ""})],
        [dict(none, delta={"content": "Hello"})],
        [dict(none, delta={"content": " world"})],
        [dict(none, delta={"content": "!"})],
        [dict(none, delta={}, finish_reason="stop")],
        [],
    ]
    assert events[-2]["usage"] == usage(n_prompt)
    assert all(e["usage"] is None for e in events[:-2])
    assert {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert len({e["id"] for e in events[:-1]}) == 1
    assert events[0]["id"] == fake.submits()[-1].request_id


def test_chat_stream_without_usage(router: str) -> None:
    events = post(router, CHAT, {"messages": USER, "stream": True}).events()
    assert len(events) == 6 and events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_chat_non_stream(router: str, fake: FakeCluster) -> None:
    reply = post(router, CHAT, {"model": MODEL, "messages": USER})
    assert reply.status == 200
    body = reply.json()
    n_prompt = len(fake.submits()[-1].token_ids)
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"] == fake.submits()[-1].request_id
    assert body["choices"] == [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                "message": {"role": "assistant", "content": "Hello world!"}}]
    assert body["usage"] == usage(n_prompt)


def test_completion_stream_and_non_stream(router: str, fake: FakeCluster) -> None:
    events = post(router, COMPL, {"prompt": "Once upon", "stream": True,
                                  "stream_options": {"include_usage": True}}).events()
    none = {"logprobs": None, "finish_reason": None, "index": 0}
    assert choices(events) == [[dict(none, text=w)] for w in WORDS] + [
        [dict(none, text="", finish_reason="stop")], []]
    assert {e["object"] for e in events[:-1]} == {"text_completion"}
    body = post(router, COMPL, {"prompt": "Once upon"}).json()
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hello world!", "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"] == usage(len(fake.submits()[-1].token_ids))


def test_submit_request_contents(router: str, fake: FakeCluster,
                                 router_config: tuple) -> None:
    ids = list(range(1, 41))
    before = time.time()
    post(router, COMPL, {"prompt": ids, "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                         "top_k": 40, "seed": 3, "stop": ["\n", "END"]})
    sub: SubmitRequest = fake.submits()[-1]
    assert sub.request_id.startswith("cmpl-") and len(sub.request_id) == 5 + 32
    assert sub.token_ids == ids
    assert sub.sampling == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=40,
                                          seed=3, stop=("\n", "END"))
    config = router_config[0]
    model_config, _ = load_model_meta(config.model)
    engine_keys = compute_block_keys(ids, config.block_size, model_fingerprint(model_config))
    assert sub.block_keys == [k.hex() for k in engine_keys]
    assert len(sub.block_keys) == 2 and all(len(k) == 32 for k in sub.block_keys)
    assert before <= sub.arrival_time <= time.time()
    post(router, COMPL, {"prompt": "hi"})
    assert fake.submits()[-1].sampling == SamplingParams(max_tokens=64)  # config default


def test_first_token_before_acceptance(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: deltas(req, ["a", "b"], finish="length")
    body = post(router, COMPL, {"prompt": "x"}).json()
    assert body["choices"][0]["text"] == "ab"
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, accepted(req))] + deltas(req, ["A", "B"], logprobs=True)
    body = post(router, CHAT, {"messages": USER, "logprobs": True}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.5, -1.5]
    assert all(isinstance(c["token"], str) and c["top_logprobs"] == [] for c in content)


@pytest.mark.parametrize("rejection, retry_after", [
    (Rejection("ttft_slo", 2.2, "predicted TTFT 3.20 s exceeds the 1 s SLO"), "3"),
    (Rejection("tbt_slo", 0.4, "predicted TBT 140 ms exceeds the 100 ms SLO"), "1"),
    (Rejection("decode_full", 5.0), "5"),
])
def test_rejection_429_keeps_reason_and_retry_time(router: str, fake: FakeCluster,
                                                   rejection: Rejection,
                                                   retry_after: str) -> None:
    """The policy's reason is the error code; its retry time, rounded up to whole seconds
    (at least 1), the Retry-After header."""
    fake.script = lambda req: [(0, RequestRejected(req.request_id, rejection))]
    detail = rejection.detail or rejection.reason
    for stream in (False, True):
        reply = post(router, CHAT, {"messages": USER, "stream": stream})
        assert reply.status == 429
        assert reply.headers["retry-after"] == retry_after
        assert reply.json() == {"error": {
            "message": f"request rejected ({rejection.reason}): {detail}",
            "type": "rate_limit_error", "param": None, "code": rejection.reason}}


def test_kv_capacity_failure_is_429_with_retry_after(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, RequestFailed(req.request_id, 429, "kv_capacity",
                                                 "decode KV memory is full", 1.0))]
    reply = post(router, CHAT, {"messages": USER})
    assert (reply.status, reply.headers["retry-after"]) == (429, "1")
    assert reply.json()["error"]["code"] == "kv_capacity"


@pytest.mark.parametrize("status,expected", [(503, 503), (500, 500), (418, 500)])
def test_cluster_failures(router: str, fake: FakeCluster, status: int,
                          expected: int) -> None:
    fake.script = lambda req: [(0, RequestFailed(req.request_id, status, "boom", "no"))]
    reply = post(router, COMPL, {"prompt": "x"})
    assert reply.status == expected
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_failure_mid_stream_is_an_error_chunk(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, accepted(req))] + deltas(req, ["a", "b"])[:1] + [
        (0.05, RequestFailed(req.request_id, 503, "worker_lost", "decode-0 died"))]
    events = post(router, CHAT, {"messages": USER, "stream": True}).events()
    assert events[1]["choices"][0]["delta"] == {"content": "a"}
    assert events[2] == {"error": {"message": "decode-0 died", "type": "service_unavailable",
                                   "param": None, "code": "worker_lost"}}
    assert events[3:] == ["[DONE]"]


def test_silence_is_504_and_aborts(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: []
    started = time.monotonic()
    reply = post(router, COMPL, {"prompt": "x"})
    assert reply.status == 504 and 1.4 < time.monotonic() - started < 5
    assert reply.json()["error"]["code"] == "timeout"
    abort = fake.wait_abort(fake.submits()[-1].request_id)
    assert abort is not None and abort.reason == "router timeout"


def test_silence_mid_stream_is_an_error_chunk(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, accepted(req))] + deltas(req, ["a", "b"])[:1]
    events = post(router, COMPL, {"prompt": "x", "stream": True}).events()
    assert [e["choices"][0]["text"] for e in events[:1]] == ["a"]
    assert events[1]["error"]["code"] == "timeout" and events[2] == "[DONE]"
    assert fake.wait_abort(fake.submits()[-1].request_id) is not None


def test_a_resumable_failure_goes_on_with_a_continuation(router: str, fake: FakeCluster) -> None:
    """The decode worker died after "a b": the router submits the prompt and those two
    tokens as a continuation, whose tokens carry on the same stream, no error event."""
    def script(req: SubmitRequest) -> list:
        if not req.sampling.resumed:
            return [(0, accepted(req))] + deltas(req, ["a", " b", " c"])[:2] + [
                (0.05, RequestFailed(req.request_id, 503, "worker_lost",
                                     "decode worker lost mid-stream", resumable=True))]
        tail = deltas(req, [" c", " d"])  # ids 100, 101 again: the fake numbers by word
        return [(0, accepted(req))] + [(d, replace(m, completion_tokens=m.completion_tokens + 2,
                                                   prompt_tokens=m.prompt_tokens - 2))
                                       for d, m in tail]
    fake.script = script
    events = post(router, CHAT, {"messages": USER, "stream": True, "max_tokens": 9,
                                 "stream_options": {"include_usage": True}}).events()
    assert [c[0]["delta"].get("content") for c in choices(events)[1:5]] == [
        "a", " b", " c", " d"]
    assert not any("error" in e for e in events if isinstance(e, dict))
    first, again = fake.submits()[-2:]
    assert again.request_id == first.request_id + "-resume1"
    assert again.token_ids == first.token_ids + [100, 101]
    assert (again.sampling.resumed, again.sampling.resumed_chars) == ((100, 101), 3)
    assert again.sampling.max_tokens == first.sampling.max_tokens == 9
    assert events[-2]["usage"] == usage(len(first.token_ids), completion=4, cached=0)


def test_a_request_of_several_choices_does_not_resume(router: str, fake: FakeCluster) -> None:
    fake.script = lambda req: [(0, accepted(req))] + [
        (0.05, RequestFailed(req.request_id, 503, "worker_lost", "decode-0 died",
                             resumable=True))]
    reply = post(router, CHAT, {"messages": USER, "n": 2})
    assert reply.status == 503 and reply.json()["error"]["code"] == "worker_lost"
    assert not fake.submits()[-1].request_id.endswith("-resume1")
