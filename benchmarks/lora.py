"""What serving LoRA adapters costs a CPU step (common/model/lora.py): the default model as
a decode worker of ``launch/configs/default.toml`` runs it, its rows on the base model, all
on one adapter (rank 16 or 64, every linear of every layer), or spread over four adapters
of rank 16 (each a group of its own: two more kernel calls a fused linear each). At each
context and batch the variants run in turn, ``--rounds`` rounds, the least ms per step;
then a prompt's prefill on the base model and on one adapter. One thread by default (a
decode worker's on 2 cores).

``--live``: instead, a cluster of default.toml serving the four adapters, its requests
(streamed, distinct prompts, ``--tokens`` each, ``--concurrency`` at a time) all on the
base model or spread over the adapters, in alternate rounds: TTFT and inter-token
latency medians, and each round's wall time.

    python benchmarks/lora.py [--contexts 600] [--batches 1,8,32] [--threads 1]
    python benchmarks/lora.py --live [--rounds 2] [--requests 16] [--concurrency 8]

Prints the tables, then one JSON line (``--out`` writes it to a file too).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_step import step_ms  # noqa: E402
from benchmarks.quantized import emit, prefill_s  # noqa: E402
from common.config import ClusterConfig  # noqa: E402
from common.engine import Engine  # noqa: E402
from common.model.dummy_weights import random_adapter  # noqa: E402
from common.model.loader import load_model_source  # noqa: E402
from common.worker import engine_config  # noqa: E402
from launch.cluster import LocalCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# each variant's rows: row i on adapters[i % len]
VARIANTS = {"base": (None,), "r16": ("r16-0",), "r64": ("r64",),
            "4 x r16": ("r16-0", "r16-1", "r16-2", "r16-3")}


def make_engine(tmp: Path, blocks: int, role: str) -> Engine:
    """The default config's ``role`` engine, serving four adapters of rank 16 and one of 64."""
    config = ClusterConfig.load(str(ROOT / "launch/configs/default.toml"))
    model = load_model_source(config.model)[0]
    modules = tuple((f"r16-{i}", str(random_adapter(tmp / f"r16-{i}", model, 16, seed=i)))
                    for i in range(4)) + (("r64", str(random_adapter(tmp / "r64", model, 64))),)
    return Engine(dataclasses.replace(engine_config(config, role), num_blocks=blocks,
                                      lora_modules=modules, num_threads=None))


WORDS = ("tide moon river stone cloud garden lantern copper meadow harbor violet ember "
         "falcon orchard canyon willow thunder marble pepper glacier").split()


def prompt_text(seed: int, words: int) -> str:
    """A prompt no other shares (its first word is its seed): no cached prefix."""
    return f"{seed} " + " ".join(WORDS[(seed * 7 + 3 * j + j * j) % len(WORDS)]
                                 for j in range(words))


async def live_round(url: str, models: list[str], requests: int, concurrency: int,
                     words: int, tokens: int, seed: int) -> dict:
    """``requests`` streamed completions, request i on ``models[i % len]``: each one's TTFT
    and mean inter-token gap, and the round's wall time."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": models[i % len(models)], "prompt": prompt_text(seed + i, words),
                "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        async with gate:
            sent, times = time.perf_counter(), []
            async with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        times.append(time.perf_counter())
        ttft.append(times[0] - sent)
        itl.append((times[-1] - times[0]) / max(1, len(times) - 1))

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(one(client, i) for i in range(requests)))
    return {"wall_s": time.perf_counter() - started, "ttft_p50": statistics.median(ttft),
            "itl_p50": statistics.median(itl)}


def live(args: argparse.Namespace) -> dict:
    """default.toml's cluster serving four rank-16 adapters: rounds on the base model and
    on the adapters, alternately; the medians over rounds of each figure."""
    with tempfile.TemporaryDirectory() as tmp:
        config = ClusterConfig.load(str(ROOT / "launch/configs/default.toml"))
        model = load_model_source(config.model)[0]
        names = [f"r16-{i}" for i in range(4)]
        sets = [f"lora_modules.{n}={random_adapter(Path(tmp) / n, model, 16, seed=i)}"
                for i, n in enumerate(names)]
        cluster = LocalCluster(str(ROOT / "launch/configs/default.toml"), Path(tmp) / "logs",
                               sets + ["http_port=8640", "base_port=8150",
                                       "metrics_port=8740"])
        modes = {"base": [config.model_name], "4 adapters": names}
        rounds: dict[str, list[dict]] = {m: [] for m in modes}
        try:
            cluster.start(timeout_s=600)
            for m in modes.values():  # warm-up
                asyncio.run(live_round(cluster.url, m, 4, 4, 20, 4, seed=10**6))
            for r in range(args.rounds):
                for i, (mode, models) in enumerate(modes.items()):
                    rounds[mode].append(asyncio.run(live_round(
                        cluster.url, models, args.requests, args.concurrency,
                        args.prompt_words, args.tokens, seed=(2 * r + i) * 1000)))
        finally:
            cluster.stop()
    med = {mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
           for mode, rs in rounds.items()}
    print(f"{args.requests} requests a round, {args.concurrency} at a time, "
          f"{args.prompt_words}-word prompts, {args.tokens} tokens each; medians of "
          f"{args.rounds} rounds")
    print(f"{'mode':<12}{'TTFT p50 s':>12}{'ITL p50 ms':>12}{'round s':>10}")
    for mode, m in med.items():
        print(f"{mode:<12}{m['ttft_p50']:>12.3f}{1e3 * m['itl_p50']:>12.1f}{m['wall_s']:>10.2f}")
    ratio = {k: round(med["4 adapters"][k] / med["base"][k], 3) for k in med["base"]}
    print("adapters / base: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    return {"live": {"medians": med, "ratio": ratio, "rounds": rounds,
                     "requests": args.requests, "concurrency": args.concurrency,
                     "tokens": args.tokens, "prompt_words": args.prompt_words}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="600")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, help="3 (--live: 2)")
    ap.add_argument("--prompt", type=int, default=512, help="prefill tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="also write the JSON line here")
    ap.add_argument("--live", action="store_true", help="a cluster's requests instead")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-words", type=int, default=150)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if args.live:
        args.rounds = args.rounds or 2
        emit(live(args), args.out)
        return
    args.rounds = args.rounds or 3
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    result: dict = {"threads": args.threads, "decode_ms": {}, "prefill_ms": {}}
    with tempfile.TemporaryDirectory() as tmp:
        blocks = max(batches) * (max(contexts) + 120) // 16 + 64
        engine = make_engine(Path(tmp), blocks, "decode")
        names = list(VARIANTS)
        print(f"decode worker: linear_dtype {engine.config.linear_dtype}, threads "
              f"{args.threads}\n{'context':>8}{'batch':>6}"
              + "".join(f"{n:>18}" for n in names) + "  ms/step (ratio to base)")
        for context in contexts:
            for batch in batches:
                got: dict[str, list[float]] = {n: [] for n in names}
                for r in range(args.rounds):  # each round starts with the next variant
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        got[n].append(step_ms(engine, batch, context, distinct=True,
                                              adapters=VARIANTS[n]))
                row = {n: round(min(v), 2) for n, v in got.items()}
                result["decode_ms"][f"ctx{context}_b{batch}"] = row
                print(f"{context:>8}{batch:>6}" + "".join(
                    f"{row[n]:>10.1f} ({row[n] / row['base']:.2f}x)" for n in names))
        prefill = make_engine(Path(tmp), args.prompt // 16 + 8, "prefill")
        for n in ("base", "r16", "r64"):
            result["prefill_ms"][n] = round(1e3 * prefill_s(prefill, args.prompt, args.rounds,
                                                             VARIANTS[n][0]), 1)
        base = result["prefill_ms"]["base"]
        print(f"prefill of {args.prompt} tokens (prefill worker, dtype {prefill.config.dtype}, "
              f"linear_dtype {prefill.config.linear_dtype}): " + ", ".join(
                  f"{n} {ms:.1f} ms ({ms / base:.2f}x)" for n, ms in result["prefill_ms"].items()))
    emit(result, args.out)


if __name__ == "__main__":
    main()
