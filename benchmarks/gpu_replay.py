"""A Mooncake trace replayed on one host's cluster over each KV path (issue 26, goal 5).

    python benchmarks/gpu_replay.py --device cuda     # on the GPU box: gpu_device.sh replay
    python benchmarks/gpu_replay.py                   # the same on the CPU (~2 minutes)

For each KV path a fresh cluster (2 prefill workers, 1 decode worker and a store node;
KV layer by layer where the device's default has it; admission off: every request is
served; ``--scheduler``, by default round robin, so that a conversation's turns go to
both prefill workers and their prefixes through the store) replays the same slice of the trace: whole conversations
(``replay_metrics.conversation_slice``) at Poisson arrivals of ``--rate``; each prompt as
token ids, every hash id a fixed run of ``--block-tokens`` ids seeded by the id, so that
requests sharing hash ids share prefixes and a prefix computed by one prefill worker
reaches the other through the store; ``output_length`` tokens (at most ``--max-output``)
with ``ignore_eos``, greedy, streamed.

Paths: ``same-host`` (``kv_path = "auto"``: on a GPU CUDA IPC to the decode worker and the
store's segments pinned, on the CPU shared memory) and ``tcp`` (``kv_path =
"transfer_engine"`` and no segment files: every byte through the transfer engine's
loopback, as between hosts).

A request is ok or an error: an HTTP status, an SSE error event, a stream cut before
``[DONE]``, or no answer within ``--request-timeout``. After each replay the cluster must
come idle (``/debug/pools``: no referenced KV block). Per path: outcomes, TTFT and ITL,
the prompt tokens served from a cache and from the store, and the KV bytes by flow and
path. Greedy answers are compared with the first path's: the CPU engine is batch
invariant, so there they must be equal; a GPU's batches differ between runs, so there
differences are counted.

Prints a table, then one JSON line (also written to ``--out``) whose ``goals`` hold
``replay_errors``, ``replay_leaked_blocks`` and ``replay_answers_differ`` (over every
path) and ``replay_store_hit`` (the share of prompt tokens the store gave, same host).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.fault_load import aligned, error_message, wait_idle  # noqa: E402
from benchmarks.prefill_clusters import CPU_PINS, say  # noqa: E402
from benchmarks.replay_metrics import (  # noqa: E402
    RequestResult, conversation_slice, scale_trace, server_side, summarize,
)
from common.model.config import DUMMY_CONFIGS  # noqa: E402
from launch.cluster import ClusterError, LocalCluster  # noqa: E402
from traces.loader import default_trace_path  # noqa: E402

PATHS = {"same-host": ("auto", ""), "tcp": ("transfer_engine", 'shm_dir = ""')}
FIRST_ID = 10  # prompt ids from here: clear of the dummy models' special tokens
WORKERS = 3  # instances that hold KV: 2 prefill, 1 decode

CONFIG = """model = "{model}"
dtype = "{dtype}"
device = "{device}"
block_size = 16
http_port = {http}
base_port = {base}
scheduler = "{scheduler}"
prefill_workers = 2
token_budget = {budget}
prefill_blocks = {prefill_blocks}
decode_blocks = {decode_blocks}
admission = "none"
kv_path = "{kv_path}"
request_timeout_s = {timeout}
prefill_graph_tokens = {graph_tokens}

[slo]
ttft_s = 600.0
tbt_s = 60.0

[store]
enabled = true
segment_bytes = {segment}
{shm}
{cpu}"""


@dataclass
class Sized:
    """What a device's clusters get: pools, the step's token budget, the store's DRAM."""
    budget: int
    prefill_blocks: int
    decode_blocks: int
    segment_mb: int


# A GPU: 8B-shaped workers (2 MiB of bfloat16 KV per 16-token block), three on one card:
# 48 GB of weights and 32 GB of KV; prompts of 64-token blocks (1/8 of the trace's), mean
# ~2.4k tokens. The CPU: the pools of benchmarks/prefill.py, 16-token blocks (1/32).
SIZES = {"cuda": Sized(2048, 4096, 8192, 12288), "cpu": Sized(256, 1600, 2400, 640)}


def block_run(hash_id: int, block_tokens: int, vocab: int, seed: int) -> list[int]:
    """The token ids that stand for trace block ``hash_id`` (the same in every prompt)."""
    rng = random.Random(f"{seed}:{hash_id}")
    return [rng.randrange(FIRST_ID, vocab) for _ in range(block_tokens)]


def prompt_ids(row: dict, block_tokens: int, vocab: int, seed: int) -> list[int]:
    """A scaled trace row's prompt: its hash ids' runs, cut to its ``input_length``."""
    ids: list[int] = []
    for h in row["hash_ids"]:
        ids += block_run(h, block_tokens, vocab, seed)
    return ids[:row["input_length"]]


@dataclass
class Answer:
    """One request of the replay, as the client saw it."""
    index: int
    result: RequestResult
    text: str = ""
    cached_tokens: int = 0


async def request(client: httpx.AsyncClient, index: int, ids: list[int], max_tokens: int,
                  model: str, timeout_s: float) -> Answer:
    """One streamed completion, timed per chunk (``logprobs``: a chunk per token); never
    raises: a failure is the result's ``error``."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    text: list[str] = []
    usage: dict = {}
    error, code = "", None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/v1/completions", content=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as r:
                if r.status_code != 200:
                    raw = await r.aread()
                    code, error = r.status_code, _message(raw) or repr(raw[:120])
                else:
                    error = "stream ended without [DONE]"
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            error = ""
                            break
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = f"SSE error: {error_message(event) or line[:120]}"
                            break
                        for choice in event.get("choices") or []:
                            times.append(time.perf_counter() - t0)
                            text.append(choice.get("text") or "")
                        usage = event.get("usage") or usage
    except TimeoutError:
        error = f"no answer within {timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    gaps = tuple(b - a for a, b in zip(times, times[1:]))
    result = RequestResult(
        ttft_s=times[0] if times else None, e2e_s=time.perf_counter() - t0,
        itl_s=sum(gaps) / len(gaps) if gaps else None, gaps_s=gaps,
        output_tokens=len(times), generated_tokens=usage.get("completion_tokens"),
        error_code=code, error=error)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Answer(index, result, "".join(text), cached)


def _message(raw: bytes) -> str:
    try:
        return error_message(json.loads(raw))
    except ValueError:
        return ""


async def replay(url: str, rows: list[dict], prompts: list[list[int]], model: str,
                 timeout_s: float) -> list[Answer]:
    """Every row at its ``timestamp`` (ms after the first)."""
    async def at(i: int, row: dict) -> Answer:
        await asyncio.sleep(row["timestamp"] / 1000)
        return await request(client, i, prompts[i], row["output_length"], model, timeout_s)

    limits = httpx.Limits(max_connections=len(rows), max_keepalive_connections=len(rows))
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        return list(await asyncio.gather(*(at(i, row) for i, row in enumerate(rows))))


@dataclass
class PathRun:
    """One path's cluster, replay and what its metrics say."""
    path: str
    answers: list[Answer] = field(default_factory=list)
    leaked_blocks: int = 0
    kv_bytes: dict[str, float] = field(default_factory=dict)  # "flow/path" → bytes
    server: dict[str, Optional[float]] = field(default_factory=dict)
    seconds: float = 0.0


def kv_bytes(conductor_metrics: str) -> dict[str, float]:
    """Bytes every worker moved, by "flow/path" (``crescent_worker_kv_bytes``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(conductor_metrics):
        if family.name == "crescent_worker_kv_bytes":
            for s in family.samples:
                key = f"{s.labels['flow']}/{s.labels['path']}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def run_path(args: argparse.Namespace, index: int, path: str, rows: list[dict],
             prompts: list[list[int]], out: Path) -> PathRun:
    kv_path, shm = PATHS[path]
    size = SIZES["cpu" if args.device == "cpu" else "cuda"]
    http, base = args.base_port + 40 * index, args.base_port + 40 * index + 10
    cfg = out / f"{path}.toml"
    cfg.write_text(CONFIG.format(
        model=args.model, dtype=args.dtype, device=args.device, http=http, base=base,
        scheduler=args.scheduler, budget=size.budget, prefill_blocks=size.prefill_blocks,
        decode_blocks=size.decode_blocks, kv_path=kv_path, timeout=args.request_timeout,
        graph_tokens=args.graph_tokens,
        segment=size.segment_mb << 20, shm=shm,
        cpu=CPU_PINS.format(prefill_cores="0") if args.device == "cpu" else ""))
    cluster = LocalCluster(str(cfg), out / f"logs-{path}")
    run = PathRun(path)
    try:
        try:
            cluster.start(timeout_s=args.start_timeout)
        except ClusterError as exc:  # every request of this path fails; the next one runs
            say(f"{path}: the cluster did not start: {exc}")
            failed = RequestResult(error=f"the cluster did not start: {exc}"[:200])
            run.answers = [Answer(i, failed) for i in range(len(rows))]
            return run
        say(f"{path}: cluster up, replaying {len(rows)} requests")
        t0 = time.monotonic()
        run.answers = asyncio.run(replay(cluster.url, rows, prompts, args.model,
                                         args.request_timeout))
        run.seconds = time.monotonic() - t0
        run.leaked_blocks, _ = asyncio.run(wait_idle(cluster.url, WORKERS, 60.0))
        c = cluster.config
        conductor = httpx.get(f"http://{c.address('conductor')}:{c.port('conductor_http')}"
                              "/metrics", timeout=10).text
        router = httpx.get(cluster.url + "/metrics", timeout=10).text
        run.kv_bytes, run.server = kv_bytes(conductor), server_side(router, conductor)
    finally:
        cluster.stop()
    return run


def differing(runs: list[PathRun]) -> int:
    """Answers (both ok) that differ from the first path's answer to the same request."""
    first = {a.index: a.text for a in runs[0].answers if a.result.ok}
    return sum(1 for run in runs[1:] for a in run.answers
               if a.result.ok and a.index in first and a.text != first[a.index])


def row_of(run: PathRun) -> dict[str, Any]:
    s = summarize([a.result for a in run.answers], ttft_slo_s=600.0, tbt_slo_s=60.0)
    return {"path": run.path, "requests": s.requests, "ok": s.completed,
            "errors": s.requests - s.completed, "error_kinds": s.error_kinds,
            "ttft_p50_s": s.values["ttft_p50_s"], "ttft_p90_s": s.values["ttft_p90_s"],
            "itl_p50_s": s.values["itl_p50_s"], "replay_s": run.seconds,
            "cached_tokens": sum(a.cached_tokens for a in run.answers),
            "global_hit": run.server.get("global_hit"), "leaked_blocks": run.leaked_blocks,
            "kv_bytes": run.kv_bytes}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None,
                   help="a dummy model (default: dummy-llama3-8b on a GPU, "
                   "dummy-bench-prefill on the CPU)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--scheduler", default="round_robin",
                   help="the conductor's placement (kvcache: each turn where its prefix is)")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (Poisson)")
    p.add_argument("--block-tokens", type=int, default=None,
                   help="tokens per trace block (default 64 on a GPU, 16 on the CPU)")
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--graph-tokens", type=int, default=0,
                   help="prefill_graph_tokens: on a GPU, prompt steps as CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace", default=str(default_trace_path(REPO)))
    p.add_argument("--base-port", type=int, default=21600)
    p.add_argument("--request-timeout", type=float, default=180.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="folder for configs, logs and the JSON")
    args = p.parse_args(argv)
    gpu = args.device != "cpu"
    args.model = args.model or ("dummy-llama3-8b" if gpu else "dummy-bench-prefill")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.block_tokens = args.block_tokens or (64 if gpu else 16)
    args.path_list = [x for x in args.paths.split(",") if x]
    if args.model not in DUMMY_CONFIGS:
        p.error(f"--model must be a dummy model ({', '.join(DUMMY_CONFIGS)})")
    bad = [x for x in args.path_list if x not in PATHS]
    if bad or not args.path_list:
        p.error(f"--paths: {', '.join(PATHS)}, not {bad or 'nothing'}")
    if args.requests < 1 or args.rate <= 0 or args.block_tokens < 1:
        p.error("--requests, --rate and --block-tokens must be positive")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc)
    out = Path(args.out or REPO / "out" / "gpu_replay" / started.strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    with open(args.trace) as fh:
        trace = [json.loads(line) for line in fh if line.strip()]
    rows = scale_trace(conversation_slice(trace, args.requests), args.rate, args.seed,
                       args.block_tokens, args.max_output)
    vocab = DUMMY_CONFIGS[args.model].vocab_size
    prompts = [prompt_ids(r, args.block_tokens, vocab, args.seed) for r in rows]
    runs = [run_path(args, i, path, rows, prompts, out) for i, path in enumerate(args.path_list)]
    table = [row_of(run) for run in runs]
    differ = differing(runs)
    fmt = lambda v, f: "-" if v is None else format(v, f)
    print(f"{args.model} {args.dtype} on {args.device}: {len(rows)} requests at {args.rate:g}/s, "
          f"prompts {sum(map(len, prompts)) / len(prompts):.0f} tokens on average "
          f"(max {max(map(len, prompts))}), {args.max_output} output tokens at most")
    print(aligned([["path", "ok", "errors", "TTFT p50 s", "TTFT p90 s", "ITL p50 ms",
                    "cached tokens", "from store", "leaked blocks", "KV bytes by path"]] + [
        [r["path"], str(r["ok"]), str(r["errors"]), fmt(r["ttft_p50_s"], ".3f"),
         fmt(r["ttft_p90_s"], ".3f"),
         fmt(r["itl_p50_s"] and r["itl_p50_s"] * 1000, ".1f"), str(r["cached_tokens"]),
         fmt(r["global_hit"], ".1%"), str(r["leaked_blocks"]),
         " ".join(f"{k}={v / 2**30:.2f}G" for k, v in sorted(r["kv_bytes"].items()) if v)]
        for r in table]))
    print(f"answers that differ from the {runs[0].path} path's: {differ}")
    for r in table:
        for kind, n in r["error_kinds"].items():
            print(f"  {r['path']}: {n} x {kind}")
    same_host = next((r for r in table if r["path"] == "same-host"), None)
    result = {"bench": "gpu_replay", "started": started.isoformat(timespec="seconds"),
              "device": args.device, "model": args.model, "dtype": args.dtype,
              "requests": len(rows), "rate": args.rate, "block_tokens": args.block_tokens,
              "graph_tokens": args.graph_tokens,
              "goals": {"replay_errors": sum(r["errors"] for r in table),
                        "replay_leaked_blocks": sum(r["leaked_blocks"] for r in table),
                        "replay_answers_differ": differ,
                        "replay_store_hit": same_host and same_host["global_hit"]},
              "paths": table}
    (out / "gpu-replay.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if result["goals"]["replay_errors"] == 0 == result["goals"][
        "replay_leaked_blocks"] else 1


if __name__ == "__main__":
    sys.exit(main())
