"""The conductor's cost per placement decision as the cluster and its load grow.

One process, no sockets: a real ``Conductor`` with P prefill and D decode workers
registered, brought to a steady state (``decoding`` requests streaming, ``waiting``
placed and not yet prefilled, and placements arriving at ``rate`` a second on its clock,
so the last 20 s of them are what the shortest-first prediction looks back on), then
timed over ``--decisions`` more placements, each answered by its decode worker's
reservation and then aborted so the state stays put. Prompts are 64-4,096 tokens, a
third of them sharing a 512-token system prompt, every one's own keys after it.

What it measures is the conductor's own work per decision (``Conductor.on_submit`` and
the reservation's answer), which bounds the decisions per second one conductor makes;
the live figure with its sockets is ``serving_overhead.py``'s.

    python benchmarks/conductor_scale.py [--decisions 300] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ClusterConfig, SLOConfig  # noqa: E402
from common.kv.events import KVEvents  # noqa: E402
from common.protocol import (  # noqa: E402
    BlocksReserved, PrefillDone, RegisterWorker, RequestFinished, ReserveBlocks,
    SubmitRequest, WorkerHeartbeat, WorkerLoad,
)
from common.sampling_params import SamplingParams  # noqa: E402
from services.conductor.service import Conductor  # noqa: E402

BLOCK = 16
SYSTEM_BLOCKS = 32  # the shared system prompt: 512 tokens
# (name, prefill workers, decode workers, decoding, waiting, placements a second)
SCENARIOS = [
    ("8+8 idle", 8, 8, 0, 0, 1.0),
    ("8+8 typical", 8, 8, 256, 64, 20.0),
    ("32+32 idle", 32, 32, 0, 0, 1.0),
    ("32+32 busy", 32, 32, 2048, 256, 200.0),
    ("32+32 backlog", 32, 32, 2048, 2000, 200.0),
]


class Mail:
    """The conductor's outbox, kept for the reservations the benchmark answers."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send(self, address: str, msg: Any) -> bool:
        self.sent.append((address, msg))
        return True


class Bench:
    def __init__(self, prefill: int, decode: int, scheduler: str, seed: int) -> None:
        self.now = 1_000_000.0
        self.mail = Mail()
        config = ClusterConfig(max_queue=1_000_000, scheduler=scheduler,
                               slo=SLOConfig(ttft_s=1e9, tbt_s=1e9))
        self.c = Conductor(config, self.mail, clock=lambda: self.now)
        self.rng = random.Random(seed)
        self.n = 0
        self.live: list[str] = []  # placed and not finished, oldest first
        self.decoding = 0  # how many of the oldest of them decode
        for role, count in (("prefill", prefill), ("decode", decode)):
            for i in range(count):
                wid = f"{role}-{i}"
                self.c.on_register(RegisterWorker(wid, role, f"inbox:{wid}", f"s:{wid}", 0,
                                                  1 << 20, 1 << 15, 1 << 20, BLOCK))
                self.c.on_heartbeat(WorkerHeartbeat(wid, role, WorkerLoad(), 1 << 20, 0,
                                                    1 << 20, KVEvents(), 0))

    def submit(self) -> str:
        """Submit one prompt and answer its reservation; its request id."""
        self.n += 1
        rid = f"r{self.n}"
        blocks = self.rng.randint(4, 256)
        shared = SYSTEM_BLOCKS if self.rng.random() < 1 / 3 and blocks > SYSTEM_BLOCKS else 0
        keys = [f"{0:08x}{k:024x}" for k in range(shared)]
        keys += [f"{self.n:08x}{k:024x}" for k in range(shared, blocks)]
        self.c.on_submit(SubmitRequest(rid, list(range(blocks * BLOCK)), keys,
                                       SamplingParams(max_tokens=64), self.now))
        sent, self.mail.sent = self.mail.sent, []
        for _, m in sent:
            if isinstance(m, ReserveBlocks):
                t = self.c.tracker.get(m.request_id)
                assert t is not None
                self.c.on_reserved(BlocksReserved(m.request_id, t.decode_id, [0],
                                                  attempt=m.attempt))
        self.mail.sent.clear()
        return rid

    def prefilled(self, rid: str) -> None:
        """Its KV landed: a PrefillDone, with a compute time the calibration learns from
        (it refits the cost model every 4, which reprices the queues)."""
        t = self.c.tracker.get(rid)
        assert t is not None, "a warm-up request was refused"
        seconds = self.c.placer.cost.prefill_compute_seconds(t.prefill_tokens, 0)
        self.c.on_prefill_done(PrefillDone(
            rid, t.prefill_id, len(t.req.token_ids), 0, 0,
            seconds * self.rng.uniform(0.8, 1.25), 0, fence=t.fence))

    def finished(self, rid: str) -> None:
        t = self.c.tracker.get(rid)
        assert t is not None
        self.c.on_finished(RequestFinished(rid, t.decode_id, "length", fence=t.fence))

    def warm(self, decoding: int, waiting: int, rate: float) -> None:
        """Bring the conductor to the state: the placements of the last 20 s at ``rate``,
        the oldest of them decoding."""
        for i in range(decoding + waiting):
            self.now += 1.0 / rate
            rid = self.submit()
            if i < decoding:
                self.prefilled(rid)
            self.live.append(rid)
        self.decoding = decoding

    def time_requests(self, count: int, rate: float) -> tuple[float, float]:
        """Seconds per request over ``count`` more at ``rate``, in a steady state: each
        new one placed, the oldest waiting one prefilled, the oldest decoding finished.
        (its placement alone, all four of its messages)."""
        placing = whole = 0.0
        for _ in range(count):
            self.now += 1.0 / rate
            start = time.perf_counter()
            self.live.append(self.submit())
            placed = time.perf_counter()
            self.prefilled(self.live[self.decoding])
            self.finished(self.live.pop(0))
            end = time.perf_counter()
            placing += placed - start
            whole += end - start
            self.mail.sent.clear()
        return placing / count, whole / count

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=300)
    ap.add_argument("--scheduler", default="kvcache_centric")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the JSON line to this file")
    args = ap.parse_args()
    rows = []
    print(f"{'scenario':<16} {'P+D':>6} {'decoding':>9} {'waiting':>8} {'placed/s':>9} "
          f"{'ms/placement':>13} {'ms/request':>11} {'requests/s':>11}")
    for name, prefill, decode, decoding, waiting, rate in SCENARIOS:
        bench = Bench(prefill, decode, args.scheduler, args.seed)
        bench.warm(decoding, waiting, rate)
        placing, whole = bench.time_requests(args.decisions, rate)
        rows.append({"scenario": name, "prefill": prefill, "decode": decode,
                     "decoding": decoding, "waiting": waiting, "rate": rate,
                     "ms_per_placement": round(placing * 1e3, 4),
                     "ms_per_request": round(whole * 1e3, 4),
                     "requests_per_s": round(1.0 / whole, 1)})
        print(f"{name:<16} {prefill:>3}+{decode:<2} {decoding:>9} {waiting:>8} {rate:>9g} "
              f"{placing * 1e3:>13.3f} {whole * 1e3:>11.3f} {1.0 / whole:>11.0f}")
    line = json.dumps({"scheduler": args.scheduler, "decisions": args.decisions,
                       "rows": rows})
    if args.out:
        Path(args.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
