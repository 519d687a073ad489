"""The router's reading of the workers' /metrics (services/router/worker_scrape.py):
parsing, quantiles as Prometheus computes them, per-step summaries over the time between
two answers, and a worker that does not answer."""
from __future__ import annotations

import asyncio

from prometheus_client import generate_latest

from common.config import ClusterConfig
from common.worker_metrics import WorkerMetrics
from services.router.worker_scrape import WorkerScrapes, parse, quantile, summary


def text(m: WorkerMetrics) -> str:
    return generate_latest(m.registry).decode()


def test_quantile_interpolates_within_its_bucket() -> None:
    buckets = {0.1: 2.0, 0.2: 6.0, 0.4: 10.0, float("inf"): 10.0}
    assert quantile(0.5, buckets) == 0.1 + 0.1 * (5 - 2) / 4
    assert quantile(0.1, buckets) == 0.1 * 1 / 2
    assert quantile(1.0, buckets) == 0.4
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.9, {0.1: 1.0, float("inf"): 10.0}) == 0.1  # in +Inf: the last bound


def test_a_summary_covers_the_steps_since_the_previous_answer() -> None:
    m = WorkerMetrics()
    for _ in range(4):
        m.step("decode", 0.3, 8, 8)
    m.moved("decode", "shm", 1000)
    m.error("shm", "decode")
    m.quarantined_blocks.set(3)
    m.load(running=8, queued=2)
    first = parse(text(m), at=10.0)
    assert first.steps == {"decode": 4} and first.kv_bytes == {"decode/shm": 1000}
    alone = summary(first, None)  # since the start
    assert alone["over"] == "all" and alone["steps"]["decode"]["steps"] == 4
    assert alone["steps"]["decode"]["mean_sequences"] == 8
    assert alone["transfer_errors"] == 1 and alone["quarantined_blocks"] == 3
    assert (alone["running"], alone["queued"]) == (8, 2) and alone["kv_bytes_per_s"] == {}
    m.step("decode", 0.02, 2, 2)
    m.moved("decode", "shm", 500)
    second = summary(parse(text(m), at=12.0), first)
    d = second["steps"]["decode"]
    assert second["over"] == "recent" and d["steps"] == 1 and d["mean_sequences"] == 2
    assert abs(d["mean_s"] - 0.02) < 1e-9 and 0.01 <= d["p90_s"] <= 0.025
    assert second["kv_bytes_per_s"] == {"decode/shm": 250.0}
    assert second["total_steps"] == 5 and second["kv_bytes"] == {"decode/shm": 1500}
    idle = summary(parse(text(m), at=13.0), parse(text(m), at=12.5))
    assert idle["over"] == "all" and idle["steps"]["decode"]["steps"] == 5


def test_workers_are_read_from_their_ports_and_a_silent_one_is_down() -> None:
    assert WorkerScrapes(ClusterConfig()).section() is None  # metrics_port unset
    m = WorkerMetrics()
    m.step("prefill", 0.5, 1, 200)
    server = m.serve("127.0.0.1", 0)
    # prefill-0 is process 3 of the layout: metrics_port + 3 is the server's port
    config = ClusterConfig.from_dict({"metrics_port": server.server_port - 3,
                                      "store": {"enabled": False}})
    scrapes = WorkerScrapes(config, timeout_s=0.5)
    assert list(scrapes.urls) == ["prefill-0", "decode-0"]

    async def go() -> list:
        try:
            await scrapes.refresh()
            await scrapes.refresh()  # within min_interval_s: not asked again
            return scrapes.section()
        finally:
            await scrapes.close()

    try:
        prefill, decode = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
    assert prefill["up"] and prefill["steps"]["prefill"]["steps"] == 1
    assert decode == {"worker": "decode-0", "url": scrapes.urls["decode-0"], "up": False}
