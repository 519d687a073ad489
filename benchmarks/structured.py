"""Decode throughput with a JSON-schema grammar active vs unconstrained, at batch 32.

One real cluster (router, conductor, a prefill and a decode worker, smollm2-135m). Each
round sends 32 streamed chat requests at once, every one generating exactly ``--tokens``
tokens: unconstrained ones with ``ignore_eos``, constrained ones under a schema whose
document is far longer than that (so its grammar never ends first). Throughput is counted
in the window where all 32 sequences decode together: from the last first token to the
first last token, the tokens streamed in it per second. Rounds alternate (free,
constrained, free, ...) on the same cluster, so a noisy shared machine hits both alike:
report the ratio of the medians.

    python benchmarks/structured.py [--rounds 3] [--batch 32] [--tokens 128]

Prints a table and, last, one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launch.cluster import LocalCluster  # noqa: E402

CONFIG = """
model = "smollm2-135m"
http_port = 21990
base_port = 21993
prefill_workers = 1
decode_workers = 1
decode_blocks = 1024
heartbeat_interval_s = 0.2
admission = "none"  # measure the steps, never refuse a round's requests

[store]
enabled = false
"""
ROW = {"type": "object", "additionalProperties": False, "required": ["id", "word", "ok"],
       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                      "word": {"type": "string", "maxLength": 8},
                      "ok": {"type": "boolean"}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["rows"],
          "properties": {"rows": {"type": "array", "minItems": 100, "maxItems": 100,
                                  "items": ROW}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "rows", "schema": SCHEMA}}
TOPICS = ["fruit", "rivers", "tools", "birds", "colours", "cities", "games", "metals"]


async def _stream(client: httpx.AsyncClient, body: dict) -> list[float]:
    """Arrival times of the streamed chunks that carry text: one per token here (ASCII
    output; the role chunk and the finish chunk carry none)."""
    times: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()!r}")
        async for line in r.aiter_lines():
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
            if choices and choices[0]["delta"].get("content"):
                times.append(time.perf_counter())
    return times


async def one_round(url: str, batch: int, tokens: int, constrained: bool
                    ) -> list[list[float]]:
    """``batch`` requests at once; each one's token arrival times."""
    bodies = [{"messages": [{"role": "user", "content": f"List {TOPICS[i % 8]} as JSON "
                             f"rows (request {i})."}],
               "max_tokens": tokens, "temperature": 1.0, "seed": i, "ignore_eos": True,
               "stream": True, **({"response_format": FORMAT} if constrained else {})}
              for i in range(batch)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(*(_stream(client, b) for b in bodies))


def together_rate(streams: list[list[float]]) -> float:
    """Tokens per second while every sequence decodes: from the last first token to the
    first last token."""
    start, end = max(s[0] for s in streams), min(s[-1] for s in streams)
    if end - start < 1.0:
        raise RuntimeError(f"the shared window is {end - start:.2f}s: raise --tokens")
    return sum(start < t <= end for s in streams for t in s) / (end - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="crescent-structured-"))
    (tmp / "cluster.toml").write_text(CONFIG)
    cluster = LocalCluster(str(tmp / "cluster.toml"), tmp / "logs")
    rates: dict[str, list[float]] = {"free": [], "json_schema": []}
    try:
        cluster.start(timeout_s=180)
        for constrained in (False, True):  # warm-up: first steps, the grammar's compile
            asyncio.run(one_round(cluster.url, args.batch, 8, constrained))
        for _ in range(args.rounds):
            for mode in rates:
                rates[mode].append(together_rate(asyncio.run(one_round(
                    cluster.url, args.batch, args.tokens, mode == "json_schema"))))
    finally:
        cluster.stop()
    free, constrained = (statistics.median(rates[m]) for m in rates)
    print(f"{'mode':<12} {'median tok/s':>12}  rounds (tok/s, batch {args.batch})")
    for mode, xs in rates.items():
        print(f"{mode:<12} {statistics.median(xs):12.1f}  "
              + " ".join(f"{x:.1f}" for x in xs))
    print(f"ratio json_schema / free: {constrained / free:.3f} (goal >= 0.80)")
    print(json.dumps({"batch": args.batch, "tokens": args.tokens, "rounds": args.rounds,
                      "free_tok_s": round(free, 1), "json_schema_tok_s": round(constrained, 1),
                      "ratio": round(constrained / free, 3),
                      "free_all": [round(x, 1) for x in rates["free"]],
                      "json_schema_all": [round(x, 1) for x in rates["json_schema"]]}))


if __name__ == "__main__":
    main()
