"""The workers' own ``/metrics``, read by the router for its dashboard (``worker_metrics``
in ``GET /debug/dashboard``): each worker's and store node's step times, batch sizes, KV
bytes by flow and path, transfer errors and quarantined blocks.

Why the router reads the workers' endpoints: those numbers are what each worker serves
(common/worker_metrics.py), the very series Prometheus scrapes, so the page and Grafana
cannot disagree, and nothing new rides in heartbeats or the conductor's status. The router
knows every worker's address and port from the config. It asks only while the page is
polled (at most once a ``min_interval_s``), all workers at once with a short timeout; one
that does not answer is shown as down. Quantiles and rates are over the time between the
last two answers, or since the worker's start before there are two.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from common.config import ClusterConfig
from common.worker_metrics import metrics_port, worker_processes


@dataclass
class Scrape:
    """One answer of a worker's ``/metrics``: cumulative values, by series."""

    at: float  # time.monotonic()
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # step → le → n
    steps: dict[str, float] = field(default_factory=dict)  # step → count
    seconds: dict[str, float] = field(default_factory=dict)  # step → sum of seconds
    sequences: dict[str, float] = field(default_factory=dict)  # step → sum of sequences
    kv_bytes: dict[str, float] = field(default_factory=dict)  # "flow/path" → bytes
    errors: float = 0.0
    gauges: dict[str, float] = field(default_factory=dict)  # quarantined_blocks, running, ...


def parse(text: str, at: float) -> Scrape:
    out = Scrape(at)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            step = s.labels.get("step", "")
            if s.name == "crescent_worker_step_seconds_bucket":
                out.buckets.setdefault(step, {})[float(s.labels["le"])] = s.value
            elif s.name == "crescent_worker_step_seconds_count":
                out.steps[step] = s.value
            elif s.name == "crescent_worker_step_seconds_sum":
                out.seconds[step] = s.value
            elif s.name == "crescent_worker_step_sequences_sum":
                out.sequences[step] = s.value
            elif s.name == "crescent_worker_kv_moved_bytes_total":
                out.kv_bytes[f"{s.labels['flow']}/{s.labels['path']}"] = s.value
            elif s.name == "crescent_worker_transfer_errors_total":
                out.errors += s.value
            elif s.name == "crescent_worker_quarantined_blocks":
                out.gauges["quarantined_blocks"] = s.value
            elif s.name == "crescent_worker_sequences":
                out.gauges[s.labels["state"]] = s.value
    return out


def quantile(q: float, buckets: dict[float, float]) -> Optional[float]:
    """Prometheus's ``histogram_quantile`` over cumulative ``buckets`` (le → count): linear
    within the bucket it falls in; the largest finite bound if it falls in +Inf."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    below, lower = 0.0, 0.0
    for le in bounds:
        if buckets[le] >= rank:
            if le == float("inf"):
                return lower
            width = buckets[le] - below
            return lower + (le - lower) * ((rank - below) / width if width else 1.0)
        below, lower = buckets[le], le
    return lower


def _delta(new: dict[Any, float], old: Optional[dict[Any, float]]) -> dict[Any, float]:
    return {k: v - (old or {}).get(k, 0.0) for k, v in new.items()}


def summary(last: Scrape, previous: Optional[Scrape]) -> dict[str, Any]:
    """A worker's section: per step kind its count, mean and p50/p90 seconds and mean
    sequences; KV bytes by flow/path, in all and per second; errors; gauges. Over the time
    since ``previous`` when steps ran in it, else since the worker's start."""
    recent = previous is not None and any(
        last.steps.get(k, 0) > previous.steps.get(k, 0) for k in last.steps)
    base = previous if recent else None
    steps: dict[str, Any] = {}
    for kind, count in _delta(last.steps, base and base.steps).items():
        if count <= 0:
            continue
        buckets = _delta(last.buckets.get(kind, {}), base and base.buckets.get(kind))
        seconds = _delta(last.seconds, base and base.seconds).get(kind, 0.0)
        seqs = _delta(last.sequences, base and base.sequences).get(kind, 0.0)
        steps[kind] = {"steps": count, "mean_s": seconds / count,
                       "p50_s": quantile(0.5, buckets), "p90_s": quantile(0.9, buckets),
                       "mean_sequences": seqs / count if seqs else None}
    span = last.at - previous.at if previous is not None else 0.0
    rates = ({k: v / span for k, v in _delta(last.kv_bytes, previous.kv_bytes).items()}
             if previous is not None and span > 0 else {})
    return {"up": True, "over": "recent" if recent else "all", "steps": steps,
            "total_steps": sum(last.steps.values()), "kv_bytes": last.kv_bytes,
            "kv_bytes_per_s": rates, "transfer_errors": last.errors, **last.gauges}


class WorkerScrapes:
    def __init__(self, config: ClusterConfig, min_interval_s: float = 1.0,
                 timeout_s: float = 1.0) -> None:
        self.urls: dict[str, str] = {}
        for role, index in worker_processes(config):
            port = metrics_port(config, role, index)
            if port is not None:
                self.urls[config.instance_id(role, index)] = \
                    f"http://{config.address(role, index)}:{port}/metrics"
        self.min_interval_s = min_interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.last: dict[str, Scrape] = {}
        self.previous: dict[str, Scrape] = {}
        self.down: set[str] = set()
        self._asked = float("-inf")
        self._session: Optional[aiohttp.ClientSession] = None

    async def refresh(self) -> None:
        """Ask every worker, unless that was done less than ``min_interval_s`` ago."""
        now = time.monotonic()
        if not self.urls or now - self._asked < self.min_interval_s:
            return
        self._asked = now
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        answers = await asyncio.gather(*(self._get(url) for url in self.urls.values()))
        for worker, text in zip(self.urls, answers):
            if text is None:
                self.down.add(worker)
                continue
            self.down.discard(worker)
            if worker in self.last:
                self.previous[worker] = self.last[worker]
            self.last[worker] = parse(text, time.monotonic())

    async def _get(self, url: str) -> Optional[str]:
        assert self._session is not None
        try:
            async with self._session.get(url) as reply:
                return await reply.text() if reply.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None

    def section(self) -> Optional[list[dict[str, Any]]]:
        """One entry per worker (in the config's order); None without ``metrics_port``."""
        if not self.urls:
            return None
        return [{"worker": w, "url": url, **(
            summary(self.last[w], self.previous.get(w)) if w in self.last and
            w not in self.down else {"up": False})} for w, url in self.urls.items()]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
