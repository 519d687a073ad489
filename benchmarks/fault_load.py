"""Greedy request streams with every outcome classified (benchmarks/faults.py, soak.py).

Each request ends as exactly one of:

- ``ok``: a whole answer (HTTP 200, or an SSE stream that reached ``[DONE]``);
- ``failed``: the client was told, with a message: an HTTP error whose body is an
  OpenAI-style ``{"error": {"message": ...}}``, or an SSE error event with a message;
- ``unclear``: an error the client cannot act on: an error body without a message, a
  stream cut without an error event, a dropped connection;
- ``lost``: nothing at all (no answer, no error) within the request's deadline.

Greedy sampling (temperature 0) makes every answer checkable against a fault-free
reference: the same prompt must give the same text, whatever was killed meanwhile.
Half the requests stream (odd sequence numbers), so both error paths are exercised: an
error before the first byte is an HTTP status, after it an SSE error event.
"""
from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import httpx

# A shared system prompt of several KV blocks: later requests hit the prefix cache and the
# store, so a fault that corrupts cached KV shows up as a wrong answer.
SYSTEM = ("You answer in one short sentence. Facts: " + " ".join(
    f"the {w} is in room {i * 7 % 31};" for i, w in
    enumerate(["key", "map", "lamp", "book", "coin", "ring", "cup", "pen"] * 2)))
TOPICS = ["key", "map", "lamp", "book", "coin", "ring", "cup", "pen"]


def prompts(n: int) -> list[str]:
    """``n`` distinct questions (the system prompt is added by ``body``)."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(f"Where is the {topic}? Then count from {i} to {i + 3}.")
    return out


def body(prompt: str, max_tokens: int, stream: bool, model: str = "smollm2-135m") -> dict:
    return {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": prompt}]}


@dataclass
class Outcome:
    prompt: int  # index into the prompt list
    kind: str  # ok | failed | unclear | lost
    sent: float  # time.monotonic() when sent
    done: float  # ... when classified
    stream: bool
    text: str = ""
    detail: str = ""  # status and error message, for failures


def error_message(payload: Any) -> str:
    """The message of an OpenAI-style error object ('' when there is none)."""
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        msg = payload["error"].get("message")
        return msg if isinstance(msg, str) else ""
    return ""


async def _plain(client: httpx.AsyncClient, req: dict) -> tuple[str, str, str]:
    r = await client.post("/v1/chat/completions", json=req)
    try:
        payload = r.json()
    except ValueError:
        payload = None
    if r.status_code == 200 and isinstance(payload, dict) and payload.get("choices"):
        return "ok", payload["choices"][0]["message"]["content"] or "", ""
    msg = error_message(payload)
    return ("failed" if msg else "unclear"), "", f"HTTP {r.status_code}: {msg or r.text[:120]}"


async def _streamed(client: httpx.AsyncClient, req: dict) -> tuple[str, str, str]:
    async with client.stream("POST", "/v1/chat/completions", json=req) as r:
        if r.status_code != 200:
            raw = await r.aread()
            try:
                msg = error_message(json.loads(raw))
            except ValueError:
                msg = ""
            detail = msg or repr(raw[:120])
            return ("failed" if msg else "unclear"), "", f"HTTP {r.status_code}: {detail}"
        text: list[str] = []
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return "ok", "".join(text), ""
            event = json.loads(data)
            if "error" in event:  # the text so far is kept: it must still be right
                msg = error_message(event)
                kind = "failed" if msg else "unclear"
                return kind, "".join(text), f"SSE error: {msg or data[:120]}"
            for choice in event.get("choices") or []:
                text.append(choice.get("delta", {}).get("content") or "")
        return "unclear", "", "stream ended without [DONE] and without an error event"


async def send(client: httpx.AsyncClient, index: int, prompt: str, max_tokens: int,
               stream: bool, deadline_s: float) -> Outcome:
    """One request, classified; never raises (a client-side bug would be ``unclear``)."""
    sent = time.monotonic()
    req = body(prompt, max_tokens, stream)
    try:
        async with asyncio.timeout(deadline_s):
            kind, text, detail = await (_streamed if stream else _plain)(client, req)
    except TimeoutError:
        kind, text, detail = "lost", "", f"no answer and no error within {deadline_s:g} s"
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        kind, text, detail = "unclear", "", f"{type(exc).__name__}: {exc}"[:200]
    return Outcome(index, kind, sent, time.monotonic(), stream, text, detail)


@dataclass
class Load:
    """``concurrency`` clients, each sending the next prompt as soon as its last ended,
    until stopped or ``limit`` requests were sent. ``outcomes`` fills while it runs."""

    url: str
    prompts: list[str]
    concurrency: int = 4
    max_tokens: int = 16
    deadline_s: float = 30.0
    limit: Optional[int] = None
    backoff_s: float = 0.5  # pause of a client after a request that did not succeed
    outcomes: list[Outcome] = field(default_factory=list)
    _sent: int = 0

    async def run(self, stop: asyncio.Event) -> list[Outcome]:
        limits = httpx.Limits(max_connections=self.concurrency + 2)
        timeout = httpx.Timeout(self.deadline_s + 5)
        async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as c:
            await asyncio.gather(*(self._client(c, stop) for _ in range(self.concurrency)))
        return self.outcomes

    async def _client(self, client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set() and (self.limit is None or self._sent < self.limit):
            seq = self._sent
            self._sent += 1
            index = seq % len(self.prompts)
            outcome = await send(client, index, self.prompts[index], self.max_tokens,
                                 seq % 2 == 1, self.deadline_s)
            self.outcomes.append(outcome)
            if outcome.kind != "ok":
                await asyncio.sleep(self.backoff_s)  # as a client would, not a busy loop

    def first_ok_sent_after(self, t: float) -> Optional[Outcome]:
        """The earliest-finished successful request that was sent at or after ``t``."""
        oks = [o for o in self.outcomes if o.kind == "ok" and o.sent >= t]
        return min(oks, key=lambda o: o.done) if oks else None


def tally(outcomes: list[Outcome], reference: Optional[list[str]]) -> dict[str, int]:
    """Counts per kind, and ``wrong`` (see ``wrong``)."""
    counts = {k: sum(o.kind == k for o in outcomes)
              for k in ("ok", "failed", "unclear", "lost")}
    counts["wrong"] = 0 if reference is None else sum(map(
        lambda o: wrong(o, reference[o.prompt]), outcomes))
    return counts


def wrong(o: Outcome, expected: str) -> bool:
    """An answer that differs from the reference, or a stream that failed after text
    that is not the start of the reference."""
    if o.kind == "ok":
        return o.text != expected
    return bool(o.text) and not expected.startswith(o.text)


def reference_answers(url: str, questions: list[str], max_tokens: int,
                      deadline_s: float = 120.0, concurrency: int = 4) -> list[str]:
    """Each prompt once, ``concurrency`` at a time (greedy answers do not depend on the
    batch: tests/engine/test_batch_invariance.py), on a cluster no fault has touched;
    every one must be answered (else the run cannot be checked and this raises)."""
    async def go() -> list[Outcome]:
        gate = asyncio.Semaphore(concurrency)

        async def one(client: httpx.AsyncClient, i: int, question: str) -> Outcome:
            async with gate:
                return await send(client, i, question, max_tokens, False, deadline_s)

        async with httpx.AsyncClient(base_url=url, timeout=deadline_s + 5) as client:
            return list(await asyncio.gather(*(one(client, i, q)
                                               for i, q in enumerate(questions))))

    outs = asyncio.run(go())
    bad = [o for o in outs if o.kind != "ok"]
    if bad:
        raise RuntimeError(f"the fault-free reference run failed: {bad[0].kind} {bad[0].detail}")
    return [o.text for o in outs]


# --------------------------------------------------------------------------- cluster views
async def pools(client: httpx.AsyncClient) -> dict:
    return (await client.get("/debug/pools", timeout=5)).json()


async def wait_idle(url: str, workers: int, timeout_s: float) -> tuple[int, list[dict]]:
    """Poll ``/debug/pools`` until the conductor's status is fresh, lists ``workers``
    instances and none holds a referenced block. Returns (used blocks at the end: the
    leak, the instances); a missing instance counts as not idle."""
    deadline = time.monotonic() + timeout_s
    instances: list[dict] = []
    used = -1
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() < deadline:
            try:
                view = await pools(client)
            except (httpx.HTTPError, ValueError):
                view = {}
            instances = view.get("instances") or []
            used = sum(i["used_blocks"] for i in instances)
            fresh = view.get("age_s") is not None and view["age_s"] < 2.0
            if fresh and len(instances) == workers and used == 0:
                return 0, instances
            await asyncio.sleep(0.25)
    return max(used, 0), instances


async def wait_healthy(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get("/health", timeout=2)).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return False


# --------------------------------------------------------------------------- CLI helpers
def begin_run(bench: str, out: Optional[str], repo: Path) -> tuple[datetime, Path]:
    """(start time, output folder ``out`` or out/<bench>/<UTC time>); SIGTERM becomes a
    clean exit, so the ``finally`` that stops the cluster runs."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = datetime.now(timezone.utc)
    folder = Path(out or repo / "out" / bench / started.strftime("%Y%m%dT%H%M%SZ"))
    folder.mkdir(parents=True, exist_ok=True)
    return started, folder


def aligned(rows: list[list[str]]) -> str:
    """Rows of cells as right-aligned columns."""
    if not rows:
        return ""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)
