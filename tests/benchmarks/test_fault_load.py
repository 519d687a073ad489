"""benchmarks/fault_load.py: every way a request can end is classified exactly (over
httpx's mock transport), and wrong answers are counted, including a failed stream whose
text so far is not the start of the reference."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from benchmarks.fault_load import Outcome, send, tally


def sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


ERROR = {"error": {"message": "decode worker lost", "type": "service_unavailable",
                   "param": None, "code": "worker_lost"}}
CASES = [  # (stream, status, body) -> (kind, text)
    (False, 200, json.dumps({"choices": [{"message": {"content": "Paris."}}]}).encode(),
     ("ok", "Paris.")),
    (False, 503, json.dumps(ERROR).encode(), ("failed", "")),
    (False, 500, b"Internal Server Error", ("unclear", "")),
    (False, 400, json.dumps({"error": {"message": ""}}).encode(), ("unclear", "")),
    (True, 200, sse({"choices": [{"delta": {"role": "assistant"}}]}, delta("Pa"),
                    delta("ris.")), ("ok", "Paris.")),
    (True, 200, sse(delta("Pa"), ERROR, done=False), ("failed", "Pa")),
    (True, 200, sse(delta("Pa"), {"error": {}}, done=False), ("unclear", "Pa")),
    (True, 200, sse(delta("Pa"), done=False), ("unclear", "")),
    (True, 429, json.dumps(ERROR).encode(), ("failed", "")),
]


def run_one(stream: bool, handler, deadline_s: float = 5.0) -> Outcome:
    async def go() -> Outcome:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await send(client, 0, "q", 4, stream, deadline_s)

    return asyncio.run(go())


@pytest.mark.parametrize("stream, status, body, expected", CASES)
def test_each_ending_is_classified(stream: bool, status: int, body: bytes,
                                   expected: tuple[str, str]) -> None:
    out = run_one(stream, lambda req: httpx.Response(status, content=body))
    assert (out.kind, out.text) == expected, out
    assert out.stream == stream and out.done >= out.sent


def test_no_answer_within_the_deadline_is_lost() -> None:
    async def silent(req: httpx.Request) -> httpx.Response:
        await asyncio.sleep(10)
        return httpx.Response(200)

    out = run_one(False, silent, deadline_s=0.2)
    assert out.kind == "lost" and "0.2 s" in out.detail
    assert out.done - out.sent < 2


def test_a_dropped_connection_is_unclear() -> None:
    def drop(req: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("peer closed connection", request=req)

    out = run_one(True, drop)
    assert out.kind == "unclear" and "RemoteProtocolError" in out.detail


def test_tally_counts_wrong_answers_and_wrong_partial_streams() -> None:
    ref = ["Paris.", "Rome."]

    def o(prompt: int, kind: str, text: str) -> Outcome:
        return Outcome(prompt, kind, 0.0, 1.0, True, text)

    outcomes = [o(0, "ok", "Paris."), o(1, "ok", "Rome!"), o(0, "failed", "Par"),
                o(1, "failed", "Pa"), o(1, "failed", ""), o(0, "lost", ""),
                o(0, "unclear", "")]
    assert tally(outcomes, ref) == {"ok": 2, "failed": 3, "unclear": 1, "lost": 1,
                                    "wrong": 2}
    assert tally(outcomes, None)["wrong"] == 0
