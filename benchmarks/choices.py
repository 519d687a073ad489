"""n choices from one request vs the same n as separate requests, on a live cluster.

One real cluster (router, conductor, a prefill and a decode worker, smollm2-135m, no
store). Each round sends the same long prompt either as ONE request with ``n = K`` (one
prefill; the decode worker shares the prompt's KV blocks among the K sequences) or as K
concurrent requests with ``n = 1`` (what a server without n, or a client fanning out,
does). Every sequence generates exactly ``--tokens`` tokens (``ignore_eos``). Measured per
round: the wall time until every sequence finished, the prompt tokens the prefill side
computed (prompt minus cached, from each response's usage), and the decode worker's peak
used KV blocks (polled from /debug/pools every 20 ms). Rounds alternate on the same
cluster, each with a fresh prompt (no cache from an earlier round); report the ratios of
the medians.

    python benchmarks/choices.py [--rounds 3] [--n 8] [--prompt-words 700] [--tokens 64]

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.cluster import LocalCluster  # noqa: E402

CONFIG = """
model = "smollm2-135m"
http_port = 21980
base_port = 21983
prefill_workers = 1
decode_workers = 1
decode_blocks = 2048
heartbeat_interval_s = 0.2
admission = "none"  # measure the work, never refuse a round's requests

[store]
enabled = false
"""
T = TypeVar("T")
WORDS = ("river stone lantern orchard harbour meadow copper violin thunder garden "
         "compass saddle marble feather canyon").split()


def prompt_text(round_no: int, words: int) -> str:
    return f"Story {round_no}: " + " ".join(WORDS[(i * 7 + round_no) % len(WORDS)]
                                            for i in range(words))


async def run_round(url: str, prompt: str, n: int, tokens: int, together: bool
                    ) -> tuple[float, int, int]:
    """(seconds until every sequence ended, prompt tokens computed, sequences back)."""
    base = {"prompt": prompt, "max_tokens": tokens, "temperature": 1.0,
            "ignore_eos": True}
    bodies = [{**base, "n": n, "seed": 1}] if together else \
        [{**base, "seed": 1 + i} for i in range(n)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(client.post("/v1/completions", json=b)
                                         for b in bodies))
        seconds = time.perf_counter() - start
    computed = choices = 0
    for r in answers:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text}")
        usage = r.json()["usage"]
        computed += usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        choices += len(r.json()["choices"])
    return seconds, computed, choices


def decode_blocks(url: str) -> list[int]:
    pools = httpx.get(url + "/debug/pools", timeout=5).json()["instances"]
    return [p["used_blocks"] for p in pools if p["role"] == "decode"]


def peak_decode_blocks(url: str, fn: Callable[[], T]) -> tuple[T, int]:
    """Run ``fn()`` while polling the decode worker's used blocks; (its result, peak).
    Starts once the pool reads empty: the status lags a heartbeat, and a round must not
    see the last one's blocks."""
    deadline = time.monotonic() + 30
    while any(decode_blocks(url)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"decode blocks still used: {decode_blocks(url)}")
        time.sleep(0.05)
    seen = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.extend(decode_blocks(url))
            done.wait(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return fn(), max(seen)
    finally:
        done.set()
        watcher.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=700)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crescent-choices-"))
    (tmp / "cluster.toml").write_text(CONFIG)
    cluster = LocalCluster(str(tmp / "cluster.toml"), tmp / "logs")
    modes = {"n=K, one request": True, "K requests": False}
    rows: dict[str, list[tuple[float, int, int]]] = {m: [] for m in modes}
    prompt_tokens = 0
    try:
        cluster.start(timeout_s=180)
        for together in modes.values():  # warm-up
            asyncio.run(run_round(cluster.url, prompt_text(-1, 50), 2, 4, together))
        prompt_tokens = httpx.post(cluster.url + "/tokenize", json={
            "prompt": prompt_text(0, args.prompt_words)}).json()["count"]
        round_no = 0
        for _ in range(args.rounds):
            for mode, together in modes.items():
                round_no += 1
                prompt = prompt_text(round_no, args.prompt_words)
                (seconds, computed, got), peak = peak_decode_blocks(
                    cluster.url, lambda: asyncio.run(run_round(
                        cluster.url, prompt, args.n, args.tokens, together)))
                assert got == args.n, (mode, got)
                rows[mode].append((seconds, computed, peak))
    finally:
        cluster.stop()
    med = {m: tuple(statistics.median(r[i] for r in rs) for i in range(3))
           for m, rs in rows.items()}
    print(f"K = {args.n} sequences, prompt {prompt_tokens} tokens, {args.tokens} tokens "
          f"each; medians of {args.rounds} rounds")
    print(f"{'mode':<18} {'seconds':>8} {'prompt tok computed':>20} {'peak decode blocks':>19}")
    for mode, (s, c, b) in med.items():
        print(f"{mode:<18} {s:8.2f} {c:20.0f} {b:19.0f}")
    (s1, c1, b1), (sk, ck, bk) = med.values()
    print(f"ratios one request / K requests: time {s1 / sk:.3f}, prompt computed "
          f"{c1 / ck:.3f}, decode blocks {b1 / bk:.3f}")
    print(json.dumps({"n": args.n, "prompt_tokens": prompt_tokens, "tokens": args.tokens,
                      "rounds": args.rounds,
                      "one_request": {"s": round(s1, 3), "computed": c1, "blocks": b1},
                      "k_requests": {"s": round(sk, 3), "computed": ck, "blocks": bk},
                      "time_ratio": round(s1 / sk, 3), "computed_ratio": round(c1 / ck, 3),
                      "blocks_ratio": round(b1 / bk, 3),
                      "all": {m: [[round(x, 3) for x in r] for r in rs]
                              for m, rs in rows.items()}}))


if __name__ == "__main__":
    main()
