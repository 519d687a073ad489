"""Real clusters for end-to-end tests: every role is its own process."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from launch.cluster import LocalCluster

# CRESCENT_TEST_DEVICE=cuda runs these clusters' workers on a GPU, and CRESCENT_TEST_MODEL
# another model under the served name the tests ask for (benchmarks/gpu_device.sh: a dummy,
# since the GPU machine has no SmolLM2 weights)
DEVICE = os.environ.get("CRESCENT_TEST_DEVICE", "")
MODEL = os.environ.get("CRESCENT_TEST_MODEL", "")

BASE_CONFIG = """
model = "{model}"
http_port = {http}
base_port = {base}
prefill_workers = {prefill}
decode_workers = 1
prefill_blocks = 512
decode_blocks = 1024
prefill_chunk = 64
scheduler = "{scheduler}"
heartbeat_interval_s = 0.2
{extra}
[store]
enabled = {store}
segment_bytes = 268435456

[slo]
ttft_s = {ttft}
tbt_s = 30.0
"""


def start_cluster(tmp: Path, http: int, base: int, prefill: int = 1, store: bool = True,
                  scheduler: str = "load_balance", ttft_slo_s: float = 120.0,
                  extra: str = "") -> LocalCluster:
    """``extra``: more top-level TOML lines (e.g. 'mode = "colocated"')."""
    cfg = tmp / "cluster.toml"
    if DEVICE:
        extra = f'device = "{DEVICE}"\n' + extra
    if MODEL:
        extra = 'served_model_name = "smollm2-135m"\n' + extra
    cfg.write_text(BASE_CONFIG.format(model=MODEL or "smollm2-135m", http=http, base=base,
                                      prefill=prefill, store=str(store).lower(),
                                      scheduler=scheduler, ttft=ttft_slo_s, extra=extra))
    cluster = LocalCluster(str(cfg), tmp / "logs")
    try:
        cluster.start(timeout_s=180)
        assert_one_bootstrap(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def assert_one_bootstrap(cluster: LocalCluster) -> None:
    """Every child of a real cluster started through common/service.py's bootstrap."""
    for child in cluster.children:
        text = child.log_path.read_text(errors="replace")
        assert f"bootstrap: {child.name} (pid {child.proc.pid}," in text, child.name


@pytest.fixture(scope="package")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("cluster"), http=19400, base=19500)
    yield c
    c.stop()


def shaped_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   shapes: dict[str, tuple[int, str]]) -> Iterator[LocalCluster]:
    """The body of a module's cluster fixture parametrized over ``shapes`` (name → (HTTP
    port, extra config lines); ``yield from``): one cluster of the shape, no store."""
    port, extra = shapes[request.param]
    c = start_cluster(tmp_path_factory.mktemp(request.param), http=port, base=port + 5,
                      store=False, extra=extra)
    yield c
    c.stop()


def wait_no_leaks(cluster: LocalCluster, timeout_s: float = 10.0) -> list[dict]:
    """Poll the pool introspection until no worker holds a referenced block."""
    deadline = time.monotonic() + timeout_s
    pools: list[dict] = []
    while time.monotonic() < deadline:
        pools = httpx.get(cluster.url + "/debug/pools", timeout=5).json()["instances"]
        if pools and all(p["used_blocks"] == 0 for p in pools):
            return pools
        time.sleep(0.2)
    raise AssertionError(f"KV blocks leaked: {pools}")


@pytest.fixture
def no_leaks(cluster: LocalCluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)
