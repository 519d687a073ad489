"""Added latency per streamed token of the router path, conductor decisions/s, and
the router's CPU per streamed token.

Token overhead: a real router process streams to a real HTTP client; this process plays
the decode worker (it PUSHes TokenDelta to the router's inbox, recording when) and the
client (it timestamps each SSE chunk as it arrives), on one clock. The difference is
what the router path adds over the decode step itself: ZeroMQ hop, decode of the
message, SSE framing, HTTP write, client read.

Conductor throughput: a real conductor process with 8 prefill and 8 decode workers
registered (this process heartbeats for them, and answers each ReserveBlocks as the decode
worker it names does); N SubmitRequests are fired and the time until the N-th
RequestAccepted reaches the router inbox gives decisions/s: a placement and its decode
reservation's round trip each. (The router hears RequestAccepted once the blocks are
reserved; a run without the decode side's answers timed out every reservation instead,
and read ~42 decisions/s.)

Router streaming capacity: the router's CPU per streamed token (/proc), with ``--streams``
chat streams at once and this process playing the decode worker a step at a time, the
step's deltas sent as one TokenDeltas message (as decode workers do) or one message each:
one router core streams about 1e6 / that many tokens a second.

    python benchmarks/serving_overhead.py [--tokens 400] [--decisions 5000] [--streams 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ClusterConfig  # noqa: E402
from common.kv.events import KVEvents  # noqa: E402
from common.mailbox import Mailbox  # noqa: E402
from common.protocol import (  # noqa: E402
    BlocksReserved, RegisterWorker, RequestAccepted, RequestFailed, RequestRejected,
    ReserveBlocks, SubmitRequest, TokenDelta, TokenDeltas, WorkerHeartbeat, WorkerLoad,
)
from common.sampling_params import SamplingParams  # noqa: E402
from common.status_protocol import ClusterStatus  # noqa: E402
from launch.cluster import LocalCluster  # noqa: E402

CONFIG = """
http_port = 18800
base_port = 18900
max_queue = 1000000
scheduler = "{scheduler}"
admission = "none"
heartbeat_interval_s = 0.2
heartbeat_timeout_s = 600

[store]
enabled = false

[slo]
ttft_s = 100000.0
tbt_s = 100000.0
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def token_overhead(cfg: ClusterConfig, tokens: int, step_s: float) -> list[float]:
    conductor = Mailbox(cfg.inbox("conductor"), "bench-conductor")
    router = cfg.inbox("router")
    sent: list[float] = []
    arrived: list[float] = []

    async def play_cluster() -> None:
        while True:
            msg = await conductor.recv()
            if not isinstance(msg, SubmitRequest):
                continue
            conductor.send(router, RequestAccepted(msg.request_id, "p", "d", 0.0))
            for i in range(tokens):
                await asyncio.sleep(step_s)  # the "decode step"
                last = i == tokens - 1
                sent.append(time.perf_counter())
                conductor.send(router, TokenDelta(msg.request_id, [42], "x", None,
                                                  "length" if last else None, 5, i + 1))

    async def health() -> None:
        while True:
            conductor.send(router, ClusterStatus(True, []))
            await asyncio.sleep(0.1)

    tasks = [asyncio.create_task(play_cluster()), asyncio.create_task(health())]
    url = f"http://{cfg.host}:{cfg.http_port}"
    await wait_healthy(url)
    body = {"model": cfg.model_name, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    # aiohttp's stream reader: a light client, so the client's own parsing adds little.
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            while True:
                line = await resp.content.readline()
                if not line:
                    break
                if line.startswith(b"data: {") and b'"content":"x"' in line:
                    arrived.append(time.perf_counter())
    for t in tasks:
        t.cancel()
    conductor.close()
    return [(a - s) * 1000 for s, a in zip(sent, arrived)]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def router_cpu(cfg: ClusterConfig, pid: int, streams: int, tokens: int,
                     batched: bool) -> float:
    """The router's CPU microseconds per streamed token: ``streams`` chat streams at once,
    this process playing the decode worker (a step: one token for each stream, as one
    TokenDeltas message or one TokenDelta each) and the clients."""
    conductor = Mailbox(cfg.inbox("conductor"), "bench-conductor")
    router = cfg.inbox("router")
    ids: list[str] = []
    got = [0]

    async def play_conductor() -> None:
        while True:
            msg = await conductor.recv()
            if isinstance(msg, SubmitRequest):
                conductor.send(router, RequestAccepted(msg.request_id, "p", "d", 0.0))
                ids.append(msg.request_id)

    async def health() -> None:
        while True:
            conductor.send(router, ClusterStatus(True, []))
            await asyncio.sleep(0.1)

    async def client(session: aiohttp.ClientSession) -> None:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.content:
                got[0] += line.startswith(b"data: {") and b'"content":"x"' in line

    tasks = [asyncio.create_task(play_conductor()), asyncio.create_task(health())]
    url = f"http://{cfg.host}:{cfg.http_port}"
    await wait_healthy(url)
    body = {"model": cfg.model_name, "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        clients = [asyncio.create_task(client(session)) for _ in range(streams)]
        while len(ids) < streams:
            await asyncio.sleep(0.01)
        start = _cpu_seconds(pid)
        for i in range(tokens):
            finish = "length" if i == tokens - 1 else None
            step = [TokenDelta(rid, [42], "x", None, finish, 5, i + 1) for rid in ids]
            for msg in ([TokenDeltas(step)] if batched else step):
                conductor.send(router, msg)
            await asyncio.sleep(0.005)  # the "decode step"
        await asyncio.wait_for(asyncio.gather(*clients), 60)
        used = _cpu_seconds(pid) - start
    for t in tasks:
        t.cancel()
    conductor.close()
    if got[0] != streams * tokens:
        raise RuntimeError(f"{got[0]} of {streams * tokens} tokens arrived")
    return used / got[0] * 1e6


async def wait_healthy(url: str) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        for _ in range(600):  # the router loads its tokenizer first
            try:
                if (await client.get(url + "/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("router never became healthy")


async def _echo(inbox: str, reply: str) -> None:
    """The far end of the floor measurement: PULL → PUSH back, nothing else."""
    ctx = zmq.asyncio.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(inbox)
    push.connect(reply)
    while True:
        await push.send(await pull.recv())


async def zmq_floor(samples: int = 300) -> list[float]:
    """One-way latency of a bare ZeroMQ hop between two processes, right now (half the
    round trip): what this machine's scheduling costs any hop, our code aside."""
    inbox, reply = "tcp://127.0.0.1:18777", "tcp://127.0.0.1:18778"
    echo = subprocess.Popen([sys.executable, __file__, "--echo", inbox, reply])
    ctx = zmq.asyncio.Context()
    out, back = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    back.bind(reply)
    out.connect(inbox)
    try:
        await asyncio.sleep(1.0)
        one_way = []
        for _ in range(samples):
            t = time.perf_counter()
            await out.send(b"x" * 200)
            await back.recv()
            one_way.append((time.perf_counter() - t) * 500)
            await asyncio.sleep(0.02)
        return one_way
    finally:
        echo.kill()
        out.close(0)
        back.close(0)


def worker_inbox(role: str, i: int) -> str:
    return f"tcp://127.0.0.1:{(19990 if role == 'prefill' else 19970) - i}"


def register(mail: Mailbox, cfg: ClusterConfig, role: str, i: int) -> None:
    mail.send(cfg.inbox("conductor"), RegisterWorker(
        f"{role}-{i}", role, worker_inbox(role, i), "127.0.0.1:1", 0, 1 << 20,
        1 << 15, 100_000, 16))


async def reserve(inbox: Mailbox, cfg: ClusterConfig, instance_id: str) -> None:
    """A decode worker's answer to every ReserveBlocks: the blocks its tokens need."""
    while True:
        msg = await inbox.recv()
        if isinstance(msg, ReserveBlocks):
            blocks = -(-(msg.prompt_tokens + msg.sampling.max_tokens) // 16)
            inbox.send(cfg.inbox("conductor"), BlocksReserved(
                msg.request_id, instance_id, list(range(blocks)), attempt=msg.attempt))


async def conductor_rate(cfg: ClusterConfig, n: int) -> float:
    mail = Mailbox(cfg.inbox("router"), "bench-router")
    decoders = [Mailbox(worker_inbox("decode", i), f"bench-decode-{i}") for i in range(8)]
    answering = [asyncio.create_task(reserve(d, cfg, f"decode-{i}"))
                 for i, d in enumerate(decoders)]
    for role in ("prefill", "decode"):
        for i in range(8):
            register(mail, cfg, role, i)
            mail.send(cfg.inbox("conductor"), WorkerHeartbeat(
                f"{role}-{i}", role, WorkerLoad(), 100_000, 0, 100_000,
                KVEvents(1, "s" * 50, [f"{i * 100 + j:032x}" for j in range(50)])
                if role == "prefill" else KVEvents(), 50 if role == "prefill" else 0))
    await asyncio.sleep(1.0)
    keys = [f"{k:032x}" for k in range(40)]
    start = time.perf_counter()
    for i in range(n):
        mail.send(cfg.inbox("conductor"), SubmitRequest(
            f"r{i}", list(range(640)), keys, SamplingParams(max_tokens=16), time.time()))
    got = accepted = 0
    while got < n:
        msg = await asyncio.wait_for(mail.recv(), 30)
        if isinstance(msg, (RequestAccepted, RequestFailed, RequestRejected)):  # all decisions
            got += 1
            accepted += isinstance(msg, RequestAccepted)
    elapsed = time.perf_counter() - start
    for task in answering:
        task.cancel()
    for box in [mail, *decoders]:
        box.close()
    if accepted < n:  # then the figure would time refusals or reservations' timeouts
        raise RuntimeError(f"only {accepted} of {n} requests were accepted")
    return n / elapsed


READY = {"router": "router ready on", "conductor": "conductor ready at"}  # their logs


def run_with(scheduler: str, only: list[str], fn) -> object:  # noqa: ANN001
    """``fn(config, pids)`` against a cluster of only the roles ``only`` (pids by role)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.toml"
        path.write_text(CONFIG.format(scheduler=scheduler))
        cluster = LocalCluster(str(path), Path(tmp) / "logs")
        try:
            children = {role: cluster.spawn(role, 0) for role in only}
            deadline = time.monotonic() + 120  # a first run converts the tokenizer
            for role, child in children.items():  # until each says it is ready
                while READY[role] not in child.log_tail():
                    cluster.check_alive()
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{role} never said it was ready")
                    time.sleep(0.05)
            return asyncio.run(fn(cluster.config, {r: c.proc.pid for r, c in children.items()}))
        finally:
            cluster.stop()


def main() -> int:
    if sys.argv[1:2] == ["--echo"]:
        asyncio.run(_echo(sys.argv[2], sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--stream-tokens", type=int, default=600)
    args = ap.parse_args()
    over = run_with("load_balance", ["router"],
                    lambda cfg, _: token_overhead(cfg, args.tokens, args.step_ms / 1000))
    floor = asyncio.run(zmq_floor())
    rates = {s: run_with(s, ["conductor"], lambda cfg, _: conductor_rate(cfg, args.decisions))
             for s in ("load_balance", "kvcache_centric")}
    per_token = {batched: run_with("load_balance", ["router"], lambda cfg, pids: router_cpu(
        cfg, pids["router"], args.streams, args.stream_tokens, batched))
        for batched in (False, True)}
    p50, p99 = statistics.median(over), pct(over, 0.99)
    print(f"{'measure':<44} {'value':>10}")
    print(f"{'router path added latency per token, p50':<44} {p50:>8.3f} ms")
    print(f"{'router path added latency per token, p99':<44} {p99:>8.3f} ms")
    print(f"{'tokens measured':<44} {len(over):>10}")
    print(f"{'floor: bare ZeroMQ hop between 2 processes, p50':<44} "
          f"{statistics.median(floor):>8.3f} ms")
    for name, rate in rates.items():
        print(f"{'conductor decisions/s (' + name + ', 8P+8D)':<44} {rate:>10.0f}")
    for batched, us in per_token.items():
        how = "a step's deltas in one message" if batched else "a message per delta"
        print(f"{'router CPU per streamed token, ' + how:<44} {us:>8.1f} us")
    print(json.dumps({"token_overhead_p50_ms": round(p50, 4),
                      "token_overhead_p99_ms": round(p99, 4),
                      "zmq_hop_floor_p50_ms": round(statistics.median(floor), 4),
                      "conductor_decisions_per_s": round(rates["kvcache_centric"], 1),
                      "conductor_decisions_per_s_load_balance": round(rates["load_balance"], 1),
                      "router_cpu_us_per_token": round(per_token[True], 1),
                      "router_cpu_us_per_token_unbatched": round(per_token[False], 1),
                      "cpu_count": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
