"""Prefill benchmark of issue 12: layer-wise KV, pipeline stages, store hits, on real clusters.

``python benchmarks/prefill.py [--quick] [--breakdown] [--reps N]`` (~10 minutes on an
idle 2-core host with ``--breakdown``; ``--quick``: a smoke run, ~1).
``--device cuda --model dummy-llama3-8b --dtype bfloat16`` runs (a) and (c) on a GPU (no
pipeline: its stages would share the one card; ``benchmarks/gpu_device.sh``).
Every configuration is a real cluster (launch/cluster.py: each role its own process)
serving the dummy LLaMA ``dummy-bench-prefill-wide`` (4 layers, hidden 1024, intermediate
2048, 2 heads and 2 KV heads of 64, float32: 4 KiB of KV per token; random weights), sized
as the issue asks, so that each run takes seconds (1k tokens ~0.55 s on one core) and with
LLaMA-3-8B's balance of attention to projection FLOPs; ``--model dummy-bench-prefill``
(hidden 256, intermediate 512: the same KV, 1k tokens in ~0.08 s, attention-heavy) gives
the runs A-I of BENCHMARKS.md. The clusters run at once and
the requests are interleaved across them, one at a time, so that the host's background
load hits every configuration alike. Prompts go as token ids to ``/v1/completions``,
streamed, 2 output tokens: TTFT is the client's time to the first token's chunk. Per
request the conductor's ``/metrics`` give what the prefill reported in ``PrefillDone``
(differences of histogram sums around the request): its compute share
(``crescent_prefill_compute_seconds``) and the time it was blocked on transfers
(``crescent_prefill_transfer_wait_seconds``); the placement counter names the instance.
``prefill CPU s`` is the CPU time of the prefill processes meanwhile (/proc), which
background load does not inflate.

Every prefill process runs one thread pinned to core 0, except the pipeline's second
stage, which shares core 1 with decode and the services (a 2-core host).

(a) Extra TTFT of moving KV. ``layerwise`` / ``after``: 2 prefill instances, store on,
    ``kv_layerwise`` true / false (KV to decode and new blocks to the store layer by layer
    during compute, or whole blocks after it). Compute alone = the ``after`` prefill's
    compute share (nothing moves while it computes); extra = TTFT − compute alone
    (medians; it includes the fixed serving path: router, conductor, first-token hop),
    split into KV work on the compute core, waits, and the path outside the prefill.
    ``--breakdown`` adds both modes with the store off (KV to decode only). Unique
    prompts: no cache hits (checked).
(b) CPP: one group of ``prefill_stages = 2`` (one core each) vs one worker on one core:
    the ``layerwise`` cluster's cold samples at that length (the same worker config).
(c) Store hits: after each cold prompt P of (a), P' = the first 90 % of P and a new 10 %
    goes to the other instance (round robin), whose local cache never saw P: its prefix
    comes from the store (checked: usage cached_tokens and the conductor's global hit
    tokens). Before P' the benchmark waits, untimed, until the conductor's global index
    holds P's blocks.

``--timeline`` runs the clusters with ``CRESCENT_TIMELINE_DIR`` set (common/timeline.py)
and adds (d): where each length's cold and warm requests' time to the first token went
outside the compute, hop by hop (benchmarks/timeline.py).

``--kv-path transfer_engine`` moves every byte (KV to decode, to and from the store, hidden
states between stages) through the transfer engine over loopback TCP, as across hosts.

Prints a table per part, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.prefill_clusters import (  # noqa: E402
    CLUSTERS, INDEX_KEYS, RequestFailed, Run, say,
)
from benchmarks.prefill_report import (  # noqa: E402
    BLOCK, CACHED_SHARE, Sample, goals, part_a, part_b, part_c, reps_for, sibling, table, total,
    unique_prompt,
)
from benchmarks import timeline  # noqa: E402
from common.kv.memory import KV_DTYPES  # noqa: E402
from common.model.config import DUMMY_CONFIGS  # noqa: E402
from common.timeline import ENV_DIR  # noqa: E402
from common.store.policy import MetadataConfig  # noqa: E402

MODEL = "dummy-bench-prefill-wide"
def step(run: Run, n: int, args: argparse.Namespace, rng: random.Random,
         samples: dict[str, list]) -> None:
    """A cold unique prompt P of ``n`` tokens and, on a 2-instance store cluster at a
    cache length, its 90 % sibling P' right after (round robin: on the other instance).
    A request the cluster fails goes to ``samples["failed"]`` (and out of the medians)."""
    try:
        _step(run, n, args, rng, samples)
    except RequestFailed as exc:
        samples["failed"].append({"tokens": n, "error": str(exc)})
        say(f"FAILED: {exc}")


def _step(run: Run, n: int, args: argparse.Namespace, rng: random.Random,
          samples: dict[str, list]) -> None:
    prompt = unique_prompt(rng, n)
    keys = total(run.scrape(), INDEX_KEYS)
    cold = run.send(prompt)
    if cold.cached:
        raise RuntimeError(f"{run.name}: a unique prompt hit a cache ({cold})")
    samples["cold"].append(cold)
    say(f"{run.name} cold: {cold}")
    if run.name in ("layerwise", "after") and n in args.cache_lengths:
        run.wait_index(keys + n // BLOCK)  # untimed: the store holds P
        warm = run.send(sibling(prompt, CACHED_SHARE, rng))
        if warm.instance == cold.instance:
            raise RuntimeError(f"{run.name}: P' ran where P did ({warm.instance})")
        samples["warm"].append(warm)
        say(f"{run.name} warm: {warm}")


def run_all(args: argparse.Namespace, rng: random.Random,
            out: Path) -> dict[str, dict[str, list[Sample]]]:
    """Every cluster up at once, requests interleaved across them (one at a time, the
    order rotating per rep), so that a change in the host's background load hits every
    configuration alike; then all stopped."""
    runs: list[Run] = []
    try:
        names = [n for n in CLUSTERS if (args.breakdown or "nostore" not in n)
                 and (n != "cpp2" or args.cpp_lengths)]
        for i, name in enumerate(names):
            runs.append(Run(name, i, out, args))
            runs[-1].start()
            say(f"{name} up")
        for run in runs:
            for _ in range(2):  # first forwards, thread pools, KV paths of both instances
                run.send(unique_prompt(rng, 300))
        res: dict[str, dict[str, list]] = {r.name: {"cold": [], "warm": [], "failed": []}
                                           for r in runs}
        if args.device != "cpu":  # Triton compiles for each new shape at its first use
            for n in args.lengths:
                for run in runs:
                    step(run, n, args, rng, {"cold": [], "warm": [], "failed": []})
        for n in args.lengths:
            for rep in range(reps_for(n, args.reps)):
                for run in runs[rep % len(runs):] + runs[:rep % len(runs)]:
                    if run.name != "cpp2" or n in args.cpp_lengths:
                        step(run, n, args, rng, res[run.name])
        return res
    finally:
        for run in runs:
            run.stop()


# --------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: short prompts, one rep")
    p.add_argument("--reps", type=int, default=None,
                   help="requests per length of 16k tokens and more, more below: 8x at 1k, "
                   "2x at 4k (default 3; --quick 1)")
    p.add_argument("--breakdown", action="store_true",
                   help="also (a) with the store off: KV to the decode worker only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-mb", type=int, default=640, help="the store node's DRAM")
    p.add_argument("--out", default=None, help="configs and logs (default: a temp dir)")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-path", choices=["auto", "transfer_engine"], default="auto",
                   help="transfer_engine: KV to decode, to and from the store and between "
                   "stages over the transfer engine's TCP loopback, as across hosts (auto: "
                   "shared memory on one host)")
    p.add_argument("--device", default="cpu",
                   help="cuda: no core pins and no pipeline (its stages would share one GPU)")
    p.add_argument("--graph-tokens", type=int, default=0,
                   help="on a GPU, prompt steps of up to this many tokens replay CUDA graphs "
                   "(prefill_graph_tokens; 0: eager)")
    p.add_argument("--timeline", action="store_true",
                   help="time each request's stages in every process: (d)")
    p.add_argument("--lengths", default=None,
                   help="prompt lengths, comma-separated (default 1024,4096,16384; "
                   "--quick 512,2048)")
    args = p.parse_args(argv)
    args.lengths = ([int(n) for n in args.lengths.split(",")] if args.lengths
                    else [512, 2048] if args.quick else [1024, 4096, 16384])
    args.cpp_lengths = args.lengths[-1:] if args.device == "cpu" else []
    args.cache_lengths = args.lengths[-1:] if args.quick else args.lengths[1:]
    args.reps = args.reps or (1 if args.quick else 3)
    if args.reps < 1:
        p.error("--reps must be >= 1")
    need = store_mb_needed(args)
    if args.segment_mb < need:  # eviction would hide P from the check before each P'
        p.error(f"--segment-mb {args.segment_mb} cannot hold what this run stores: "
                f"{need} MiB of {args.model} KV ({args.dtype})")
    return args


def store_mb_needed(args: argparse.Namespace) -> int:
    """The store's DRAM a run needs: every cold prompt, its sibling's new tenth and the
    warm-up prompts, in whole blocks of the model's KV, below the eviction watermark."""
    per_token = kv_bytes_per_token(args)
    warmups = 1 if args.device != "cpu" else 0  # run_all: a step per length first on a GPU
    tokens = 4 * 300 + sum((reps_for(n, args.reps) + warmups) * n * (1 + (1 - CACHED_SHARE))
                           for n in args.lengths)
    # the store evicts past its high watermark (services/store_master/metadata.py), not when full
    return int(tokens * per_token / MetadataConfig().high_watermark) // (1 << 20) + 1


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """KV bytes per token of a dummy model (0 for any other model)."""
    cfg = DUMMY_CONFIGS.get(args.model)
    if cfg is None:
        return 0
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * KV_DTYPES[args.dtype].itemsize


def describe(args: argparse.Namespace) -> str:
    """The model's shape as the report's header gives it."""
    cfg = DUMMY_CONFIGS.get(args.model)
    if cfg is None:
        return f"{args.dtype} on {args.device}"
    per_token = kv_bytes_per_token(args)
    return (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, intermediate "
            f"{cfg.intermediate_size}, {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads "
            f"x {cfg.head_dim}, {args.dtype} on {args.device} ({per_token >> 10} KiB KV/token)")


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.now(timezone.utc)
    out = Path(args.out or tempfile.mkdtemp(prefix="crescent-prefill-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    load0 = os.getloadavg()
    if args.timeline:  # the clusters' processes inherit it
        os.environ[ENV_DIR] = str(out / "timeline")
    res = run_all(args, rng, out)
    a = part_a(res, args.lengths)
    b = part_b(res, args.cpp_lengths)
    c = part_c(res, args.cache_lengths)
    about = describe(args)
    print(f"{args.model}: {about}; KV path {args.kv_path}; "
          f"{args.reps} rep(s) per cell at 16k, 2x at 4k, 8x at 1k, medians; "
          f"{os.cpu_count()} CPUs, "
          f"load average {load0[0]:.2f} before, {os.getloadavg()[0]:.2f} after; logs in {out}")
    print("\n(a) extra TTFT of moving KV (to decode and store) over compute alone (the "
          "after-prefill prefill's compute share)")
    print(table(a, [("tokens", "tokens", "d"), ("mode", "mode", ""), ("ttft_s", "TTFT s", ".3f"),
                    ("compute_alone_s", "compute alone s", ".3f"),
                    ("compute_s", "own compute s", ".3f"), ("wait_s", "wait s", ".3f"),
                    ("extra_s", "extra s", "+.3f"), ("extra_pct", "extra %", "+.1f"),
                    ("on_core_s", "on core s", "+.3f"), ("outside_s", "outside s", ".3f"),
                    ("admit_s", "admission s", ".3f"), ("around_s", "around s", ".3f"),
                    ("cpu_s", "prefill CPU s", ".2f"),
                    ("cpu_vs_after_pct", "CPU vs after %", "+.1f")]))
    print("\n(b) chunked pipeline: 2 stages (cores 0, 1) vs 1 worker (core 0)")
    print(table(b, [("tokens", "tokens", "d"), ("one_worker_ttft_s", "1 worker TTFT s", ".3f"),
                    ("two_stages_ttft_s", "2 stages TTFT s", ".3f"),
                    ("two_stages_head_compute_s", "head compute s", ".3f"),
                    ("two_stages_head_wait_s", "head wait s", ".3f"),
                    ("one_worker_cpu_s", "1 worker CPU s", ".2f"),
                    ("two_stages_cpu_s", "2 stages CPU s", ".2f"), ("speedup", "speedup", ".2f")]))
    print(f"\n(c) TTFT with {CACHED_SHARE:.0%} of the prompt in the store vs cold")
    print(table(c, [("tokens", "tokens", "d"), ("mode", "mode", ""),
                    ("cold_ttft_s", "cold s", ".3f"),
                    ("warm_ttft_s", "warm s", ".3f"), ("warm_compute_s", "warm compute s", ".3f"),
                    ("warm_wait_s", "warm wait s", ".3f"),
                    ("warm_admit_s", "warm admission s", ".3f"),
                    ("warm_around_s", "warm around s", ".3f"),
                    ("cached", "cached", ".0f"), ("global_hit", "from store", ".0f"),
                    ("cacheable", "cacheable", "d"), ("speedup", "speedup", ".2f"),
                    ("cpu_speedup", "CPU ratio", ".2f")]))
    d = stages(res, out / "timeline") if args.timeline else {}
    if d:
        print("\n(d) where the time to the first token went (benchmarks/timeline.py)")
        print(timeline.render(d))
    failed = [(name, f) for name, v in res.items() for f in v["failed"]]
    if failed:
        print(f"\n{len(failed)} request(s) failed (left out of the medians):")
        for name, f in failed:
            print(f"  {name}, {f['tokens']} tokens: {f['error']}")
    print(json.dumps({"bench": "prefill", "started": started.isoformat(timespec="seconds"),
                      "quick": args.quick, "reps": args.reps, "model": args.model,
                      "device": args.device, "dtype": args.dtype, "kv_path": args.kv_path,
                      "graph_tokens": args.graph_tokens,
                      "load_average": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
                      "goals": goals(a, b, c), "a": a, "b": b, "c": c, "d": d,
                      "failed": {k: v["failed"] for k, v in res.items()},
                      "samples": {k: {kk: [asdict(s) for s in vv] for kk, vv in v.items()
                                      if kk != "failed"} for k, v in res.items()}}))
    return 0


def stages(res: dict[str, dict[str, list]], directory: Path) -> dict[str, dict]:
    """(d): ``timeline.summary`` of each cluster's cold and warm requests per length."""
    timelines = timeline.load(directory)
    names = {s.request_id: f"{s.tokens} {name} {kind}" for name, kinds in res.items()
             for kind in ("cold", "warm") for s in kinds[kind]}
    return timeline.grouped((timelines[r] for r in names if r in timelines),
                            lambda t: names[t.request_id])


if __name__ == "__main__":
    sys.exit(main())
