"""A multi-host Crescent cluster on one machine: three network namespaces (launch/netns.py)
as hosts, each process started with ``crescent serve`` on the host its ``[hosts]`` address
belongs to (launch/multihost.py), and a single-host cluster of the same config as the
reference. Skipped where namespaces cannot be made (not root, no iproute2)."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.fault_load import prompts, reference_answers
from benchmarks.faults import config_data
from benchmarks.live_replay import to_toml
from launch import forkserver
from launch.cluster import LocalCluster
from launch.multihost import NetnsCluster
from launch.netns import TestBed, available

OK, WHY = available()
# Ports 21300-21499: the multi-host cluster 21400 (base 21410), the single-host one 21450
# (base 21460), the pipelined one 21470 (base 21480).
MULTI_HTTP, SINGLE_HTTP, PIPELINE_HTTP = 21400, 21450, 21470
PREFIX, SUBNET = "cmhe", "10.77.0"
H1, H2, H3 = (f"{SUBNET}.{i}" for i in (1, 2, 3))
# h1: router, conductor, store master and a second prefill worker (no store node: every
# store read it makes crosses hosts); h2: prefill-0 and store node 0; h3: decode, node 1
# and a second router (``routers = 2``: the conductor replies to each at its own host).
HOSTS = {"router": [H1, H3], "conductor": H1, "store_master": H1, "prefill": [H2, H1],
         "decode": [H3], "store_node": [H2, H3]}
QUESTIONS = prompts(6)
MAX_TOKENS = 12


def write_config(path: Path, http: int, prefill: int, nodes: int, hosts: dict,
                 stages: int = 1) -> str:
    """The fault suite's cluster (small pools, fast heartbeats, quick restarts) with
    round-robin placement, ``nodes`` store nodes and ``hosts`` as its [hosts] table (a
    router per address its router list has)."""
    data = config_data(http, prefill, 1, "round_robin", router_timeout=60.0, stages=stages)
    data["store"]["nodes"] = nodes
    if isinstance(hosts.get("router"), list):
        data["routers"] = len(hosts["router"])
    table = "".join(f"{role} = {json.dumps(where)}\n" for role, where in hosts.items())
    path.write_text(to_toml(data) + (f"\n[hosts]\n{table}" if hosts else ""))
    return str(path)


def kv_bytes(metrics_text: str) -> dict[tuple[str, str, str], float]:
    """(instance, flow, path) → bytes, from the conductor's ``crescent_worker_kv_bytes``."""
    return {(s.labels["instance"], s.labels["flow"], s.labels["path"]): s.value
            for family in text_string_to_metric_families(metrics_text)
            if family.name == "crescent_worker_kv_bytes" for s in family.samples}


def conductor_metrics(cluster: LocalCluster) -> str:
    c = cluster.config
    url = f"http://{c.address('conductor')}:{c.port('conductor_http')}/metrics"
    return httpx.get(url, timeout=5).text


@pytest.fixture(scope="package")
def single_host(bed: TestBed, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The reference: the same questions on a one-host cluster; its answers and the KV
    bytes by path its conductor reported."""
    tmp = tmp_path_factory.mktemp("single")
    cluster = LocalCluster(write_config(tmp / "cluster.toml", SINGLE_HTTP, 1, 1, {}),
                           tmp / "logs", forkserver=forkserver.shared())
    with cluster:
        answers = reference_answers(cluster.url, QUESTIONS, MAX_TOKENS)
        text = wait_metrics(cluster, lambda t: ("prefill-0", "decode", "shm") in kv_bytes(t))
    return {"answers": answers, "kv_bytes": kv_bytes(text)}


def wait_metrics(cluster: LocalCluster, ready: Callable[[str], bool],
                 timeout_s: float = 10.0) -> str:
    """The conductor's /metrics once ``ready(text)`` (heartbeats carry the numbers)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        text = call(cluster, conductor_metrics, cluster)
        if ready(text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"conductor metrics not ready in {timeout_s:g}s:\n"
                         + "\n".join(x for x in text.splitlines() if "kv_bytes" in x))


def call(cluster: LocalCluster, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn`` from where the cluster's clients are: the router's host of a bed, or here."""
    if isinstance(cluster, NetnsCluster):
        return cluster.call(fn, *args, **kwargs)
    return fn(*args, **kwargs)


@pytest.fixture(scope="package")
def bed() -> Iterator[TestBed]:
    if not OK:
        pytest.skip(f"multi-host test bed unavailable: {WHY}")
    with TestBed(3, PREFIX, SUBNET) as made:
        yield made


@pytest.fixture(scope="module")
def multihost(bed: TestBed, single_host: dict,  # noqa: ARG001 (after the reference)
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    """Started after the reference ran (two clusters at once would share 2 cores)."""
    tmp = tmp_path_factory.mktemp("multihost")
    cluster = NetnsCluster(write_config(tmp / "cluster.toml", MULTI_HTTP, 2, 2, HOSTS),
                           tmp / "logs", bed)
    with cluster:
        yield cluster
