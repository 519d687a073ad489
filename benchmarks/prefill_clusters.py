"""The live clusters of benchmarks/prefill.py: their configs, and ``Run``, which sends one
prompt to a cluster and reads from the conductor's metrics what its prefill did."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

import httpx
import orjson

from benchmarks.prefill_report import BLOCK, Sample, changed_label, total
from launch.cluster import LocalCluster

COMPUTE = "crescent_prefill_compute_seconds"
WAIT = "crescent_prefill_transfer_wait_seconds"
ADMIT = "crescent_prefill_admission_seconds"
ACCEPTED = "crescent_conductor_actual_prefill_ttft_seconds"  # accept → KV on decode
HITS = "crescent_global_cache_hit_tokens_total"
INDEX_KEYS = "crescent_conductor_global_index_keys"
PLACED = "crescent_conductor_placed_total"

BASE = """model = "{model}"
dtype = "{dtype}"
device = "{device}"
block_size = {block}
token_budget = {budget}
http_port = {http}
scheduler = "round_robin"
base_port = {base}
admission = "none"
prefill_blocks = {prefill_blocks}
decode_blocks = {decode_blocks}
heartbeat_interval_s = 0.5
kv_wait_timeout_s = 300.0
request_timeout_s = 600.0
kv_path = "{kv_path}"
{extra}
[slo]
ttft_s = 3600.0
tbt_s = 60.0

[store]
enabled = {store}
segment_bytes = {segment}
{store_shm}
{cpu}"""
# A 2-core host: prefill on core 0 (the pipeline's second stage shares core 1 with decode)
CPU_PINS = """
[cpu]
prefill_cores = "{prefill_cores}"
prefill_threads = 1
colocated_cores = "0"
colocated_threads = 1
decode_cores = "1"
"""

# name → (extra top-level TOML, store on, prefill cores)
CLUSTERS: dict[str, tuple[str, bool, str]] = {
    "layerwise": ("prefill_workers = 2\nkv_layerwise = true", True, "0"),
    "after": ("prefill_workers = 2\nkv_layerwise = false", True, "0"),
    "cpp2": ("prefill_workers = 1\nprefill_stages = 2\nkv_layerwise = true", True, "0-1"),
    # --breakdown: KV to the decode worker only
    "layerwise-nostore": ("prefill_workers = 1\nkv_layerwise = true", False, "0"),
    "after-nostore": ("prefill_workers = 1\nkv_layerwise = false", False, "0"),
}


class RequestFailed(RuntimeError):
    """The cluster answered a request with an error: recorded, and the run goes on."""


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, every thread (kernel's /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- clusters
class Run:
    """One live cluster; ``send`` one prompt and read what the conductor saw of it."""

    def __init__(self, name: str, index: int, out: Path, args: argparse.Namespace) -> None:
        extra, store, cores = CLUSTERS[name]
        http, base = 21100 + 10 * index, 21000 + 20 * index
        cfg = out / f"{name}.toml"
        if args.device == "cpu":  # pinned cores, room to spare, 256 tokens per step
            budget, prefill_blocks, decode_blocks = 256, 1600, 2400
            pins = CPU_PINS.format(prefill_cores=cores)
        else:  # pools sized to the longest prompt (one request at a time): two clusters of
            # 8B workers fit one card
            budget, pins = 2048, ""
            prefill_blocks = decode_blocks = max(args.lengths) // BLOCK + 64
        cfg.write_text(BASE.format(
            model=args.model, dtype=args.dtype, device=args.device, http=http, base=base,
            block=BLOCK, extra=extra + f"\nprefill_graph_tokens = {args.graph_tokens}",
            store=str(store).lower(), segment=args.segment_mb << 20,
            budget=budget, prefill_blocks=prefill_blocks, decode_blocks=decode_blocks,
            cpu=pins, kv_path=args.kv_path,
            store_shm='shm_dir = ""' if args.kv_path == "transfer_engine" else ""))
        self.model = args.model
        self.name = name
        self.cluster = LocalCluster(str(cfg), out / f"logs-{name}")
        c = self.cluster.config
        self.metrics_url = f"http://{c.host}:{c.port('conductor_http')}/metrics"
        self.http = httpx.Client(timeout=600)

    def start(self) -> None:
        try:
            self.cluster.start(timeout_s=180)
        except BaseException:
            self.cluster.stop()
            raise

    def stop(self) -> None:
        self.http.close()
        self.cluster.stop()

    def scrape(self) -> str:
        return self.http.get(self.metrics_url, timeout=10).text

    def cpu(self) -> float:
        return sum(cpu_seconds(c.proc.pid) for c in self.cluster.children
                   if c.role in ("prefill", "colocated"))

    def send(self, ids: list[int]) -> Sample:
        """Stream one completion of 2 tokens; TTFT = the first token's chunk (logprobs on,
        so a token whose text is still incomplete UTF-8 has a chunk too)."""
        before = self.scrape()
        cpu0 = self.cpu()
        ttft, usage, request_id = self._stream(ids)
        after = self._after(before)
        cpu = self.cpu() - cpu0
        def diff(name: str) -> Optional[float]:
            return None if after is None else total(after, name) - total(before, name)
        hits = diff(HITS)
        return Sample(len(ids), ttft, diff(COMPUTE + "_sum"), diff(WAIT + "_sum"), cpu,
                      usage["prompt_tokens_details"]["cached_tokens"],
                      None if hits is None else round(hits),
                      changed_label(before, after or self.scrape(), PLACED, "prefill") or "?",
                      diff(ADMIT + "_sum"), diff(ACCEPTED + "_sum"), request_id)

    def _stream(self, ids: list[int]) -> tuple[float, dict, str]:
        ttft: Optional[float] = None
        usage: Optional[dict] = None
        request_id = "?"
        body = {"model": self.model, "prompt": ids, "max_tokens": 2, "temperature": 0,
                "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        content = orjson.dumps(body)  # 0.07 ms for 16k ids; httpx's json= took 1.6 ms here
        with self.http.stream("POST", self.cluster.url + "/v1/completions", content=content,
                              headers={"Content-Type": "application/json"}) as r:
            if r.status_code != 200:
                raise RequestFailed(f"{self.name}: HTTP {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RequestFailed(f"{self.name}: {len(ids)} tokens: {chunk['error']}")
                if chunk.get("choices") and ttft is None:
                    ttft = time.perf_counter() - t0
                    request_id = chunk["id"]
                usage = chunk.get("usage") or usage
        if ttft is None or usage is None:
            raise RuntimeError(f"{self.name}: the stream had no token or no usage")
        return ttft, usage, request_id

    def _after(self, before: str, timeout_s: float = 5.0) -> Optional[str]:
        """A scrape that counts this request's PrefillDone, or None if it never came."""
        want = total(before, COMPUTE + "_count") + 1
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.scrape()
            if total(text, COMPUTE + "_count") >= want:
                return text
            if time.monotonic() > deadline:
                say(f"{self.name}: PrefillDone not counted by the conductor")
                return None
            time.sleep(0.02)

    def wait_index(self, keys: float, timeout_s: float = 30.0) -> float:
        """Wait until the conductor's global index holds ``keys`` blocks; seconds waited."""
        t0 = time.monotonic()
        while total(self.scrape(), INDEX_KEYS) < keys:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"{self.name}: the store never reported {keys:.0f} blocks")
            time.sleep(0.05)
        return time.monotonic() - t0


def say(text: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)
