"""Each worker and store node of a real cluster serves its own /metrics (common/
worker_metrics.py): after a request its step counts and KV bytes have grown, and the
router's dashboard data shows the same numbers (services/router/worker_scrape.py); the
decode worker's steps reach the conductor's decode calibration. A
colocated worker moves no KV (one process; layer-wise it puts nothing in the store), so
there only its steps are checked."""
from __future__ import annotations

import time
import uuid
from collections import defaultdict

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.worker_metrics import metrics_port, worker_processes
from launch.cluster import LocalCluster

pytestmark = pytest.mark.e2e
Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(url: str) -> Series:
    """name → labels → value, of one /metrics answer."""
    out: Series = defaultdict(dict)
    reply = httpx.get(url, timeout=5)
    reply.raise_for_status()
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def total(series: Series, name: str, **labels: str) -> float:
    return sum(v for key, v in series[name].items() if set(labels.items()) <= set(key))


def scrape_all(cluster: LocalCluster) -> dict[str, Series]:
    c = cluster.config
    return {c.instance_id(r, i): scrape(f"http://{c.address(r, i)}:"
                                        f"{metrics_port(c, r, i)}/metrics")
            for r, i in worker_processes(c)}


@pytest.mark.parametrize("shape", ["disaggregated", "colocated"])
def test_every_worker_counts_its_steps_and_kv_bytes(shared, shape: str) -> None:  # noqa: ANN001
    cluster = shared.get(shape)
    before = scrape_all(cluster)
    max_tokens = 6
    reply = httpx.post(cluster.url + "/v1/completions", timeout=120, json={
        "model": cluster.config.model_name, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True,
        "prompt": f"{uuid.uuid4()} The history of the city begins with a bridge " * 3})
    reply.raise_for_status()
    prompt = reply.json()["usage"]["prompt_tokens"]

    def grew(after: dict[str, Series], name: str, worker: str, **labels: str) -> float:
        return total(after[worker], name, **labels) - total(before[worker], name, **labels)

    after = scrape_all(cluster)
    if shape == "disaggregated":  # the prompt's KV went to the decode worker, by one path
        prefill, decode = "prefill-0", "decode-0"
        moved = grew(after, "crescent_worker_kv_moved_bytes_total", prefill, flow="decode")
        assert moved > 0, after[prefill]["crescent_worker_kv_moved_bytes_total"]
    else:  # one process prefills and decodes: its KV moves nowhere
        prefill = decode = "colocated-0"
        moved = 0
    steps = "crescent_worker_step_seconds_count"
    prefilled = sum(grew(after, "crescent_worker_step_tokens_sum", prefill, step=kind)
                    for kind in ("prefill", "mixed"))
    assert prefilled >= prompt - cluster.config.block_size  # at most a block was cached
    assert grew(after, steps, prefill, step="prefill") + grew(after, steps, prefill,
                                                              step="mixed") >= 1
    # the first token comes from the prefill; each other one is a decode or mixed step
    assert grew(after, steps, decode, step="decode") + grew(
        after, steps, decode, step="mixed") >= max_tokens - 1
    assert total(after[decode], "crescent_worker_quarantined_blocks") == 0
    if shape == "disaggregated":
        assert_decode_steps_reach_the_conductor(cluster)
    assert ("store_node-0" in after) == cluster.config.store.enabled  # it answered too

    data = httpx.get(cluster.url + "/debug/dashboard", timeout=10).json()
    shown = {w["worker"]: w for w in data["worker_metrics"]}
    assert set(shown) == set(after) and all(w["up"] for w in shown.values())
    assert shown[decode]["total_steps"] >= total(before[decode], steps) + max_tokens - 1
    assert sum(shown[prefill]["kv_bytes"].values()) >= moved


def assert_decode_steps_reach_the_conductor(cluster: LocalCluster) -> None:
    """The decode worker's beats carry its step totals; the conductor scales its decode
    profile by them (services/conductor/calibration.py DecodeCalibrator)."""
    c = cluster.config
    url = f"http://{c.address('conductor')}:{c.port('conductor_http')}/debug/ttft"
    deadline = time.monotonic() + 10
    while True:  # the beat after the last step comes within a heartbeat interval
        cost = httpx.get(url, timeout=5).json()["cost"]
        if cost["decode_samples"] or time.monotonic() > deadline:
            break
        time.sleep(c.heartbeat_interval_s)
    assert cost["decode_samples"] >= 1, cost
    assert 0.25 <= cost["decode_scale"] <= 4.0 and cost["decode_p90_abs_rel_error"] >= 0
