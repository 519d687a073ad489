"""Real clusters for end-to-end tests: every role is its own process."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterator, Optional

import httpx
import pytest

from benchmarks.timeline import Timeline, load
from common import timeline
from launch import forkserver
from launch.cluster import LocalCluster
from tests.conftest import SHARED_CLUSTER_GROUPS, xdist_group

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
prefill_blocks = 256
decode_blocks = 384
scheduler = "{scheduler}"
heartbeat_interval_s = 0.2
# the shipped profile: no calibration at each new kind of cluster's first start (the
# default config's clusters, tests/e2e/test_live_replay.py, do calibrate)
cost_profile = "cpu-smollm2-135m"
{extra}
[store]
enabled = {store}
segment_bytes = 268435456

[slo]
ttft_s = {ttft}
tbt_s = 30.0

[cpu]
affinity = {pinned}
"""


def start_cluster(tmp: Path, http: int, base: int, prefill: int = 1, store: bool = True,
                  scheduler: str = "load_balance", ttft_slo_s: float = 120.0,
                  extra: str = "", pinned: bool = False,
                  env: Optional[dict[str, str]] = None) -> LocalCluster:
    """``extra``: more top-level TOML lines (e.g. 'mode = "colocated"'). ``env``: variables
    for every child (LocalCluster). ``pinned``: each process on its role's cores
    (common/cpu.py); off by default, since the two xdist workers' clusters would share the
    same plan (every decode worker on one core while the other idles), and the operating
    system spreads them better."""
    cfg = tmp / "cluster.toml"
    if DEVICE:
        extra = f'device = "{DEVICE}"\n' + extra
    if MODEL:
        extra = 'served_model_name = "smollm2-135m"\n' + extra
    cfg.write_text(BASE_CONFIG.format(model=MODEL or "smollm2-135m", http=http, base=base,
                                      prefill=prefill, store=str(store).lower(),
                                      scheduler=scheduler, ttft=ttft_slo_s, extra=extra,
                                      pinned=str(pinned).lower()))
    # forked from the worker's fork server, but for the pinned clusters of
    # tests/e2e/test_cpu_affinity.py, which read each child's environment from /proc
    cluster = LocalCluster(str(cfg), tmp / "logs",
                           forkserver=None if pinned else forkserver.shared(), env=env)
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


LORA = "smol-lora"  # the LoRA adapter each shared cluster serves (tests/e2e/test_lora_serving.py)


def write_adapter(path: Path, model: str) -> Path:
    """``random_adapter`` of ``model`` (common/model/dummy_weights.py) at ``path``."""
    from common.model.dummy_weights import random_adapter
    from services.router.tokenizer import load_model_meta

    return random_adapter(path, load_model_meta(model)[0])


# Clusters the modules share, by shape (name → (HTTP port, store on, extra config lines)):
# request tests (API fields, tools, choices, logprobs, structured outputs, colocated
# serving) need a shape, not a cluster of their own; each leaves no block held
# (``wait_no_leaks``).
SHAPES = {
    "disaggregated": (22000, False, ""),
    "pipeline": (22020, False, "prefill_stages = 2\n"),
    "colocated": (22040, True, 'mode = "colocated"\ntoken_budget = 48\n'),
}


class SharedClusters:
    """One cluster a shape for the tests of one group (tests/conftest.py
    ``SHARED_CLUSTER_GROUPS``), booted when a test first asks for it, on the group's own
    ports, and stopped once the group's last test ends (``pytest_runtest_teardown``: a
    group's tests run as one block), so their memory is not held meanwhile."""

    live: Optional["SharedClusters"] = None  # this process's, while the package runs
    group = ""  # the group of the test running now (``pytest_runtest_setup``)

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self._tmp = tmp
        self._up: dict[str, LocalCluster] = {}

    def get(self, shape: str) -> LocalCluster:
        if shape not in self._up:
            port, store, extra = SHAPES[shape]
            group = list(SHARED_CLUSTER_GROUPS).index(self.group)
            port += 100 * group
            # each worker's /metrics: the group's ports 60-89 (workers from + 3)
            metrics = 22060 + 100 * group + 10 * list(SHAPES).index(shape)
            tmp = self._tmp.mktemp(shape)
            adapter = write_adapter(tmp / LORA, MODEL or "smollm2-135m")
            self._up[shape] = start_cluster(  # each request's stages timed (timeline_of)
                tmp, http=port, base=port + 5, store=store,
                extra=extra + f"metrics_port = {metrics}\n"
                f'lora_modules = {{ "{LORA}" = "{adapter}" }}\n',
                env={timeline.ENV_DIR: str(tmp / "timeline")})
        return self._up[shape]

    def stop(self) -> None:
        while self._up:
            self._up.popitem()[1].stop()


@pytest.fixture(scope="package")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedClusters]:
    clusters = SharedClusters.live = SharedClusters(tmp_path_factory)
    yield clusters
    clusters.stop()
    SharedClusters.live = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    SharedClusters.group = xdist_group(item.nodeid)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
    if SharedClusters.live is not None and (
            nextitem is None or "shared" not in nextitem.fixturenames
            or xdist_group(nextitem.nodeid) != xdist_group(item.nodeid)):
        SharedClusters.live.stop()


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


def timeline_of(cluster: LocalCluster, request_id: str, last: str = "first_written",
                timeout_s: float = 10.0) -> Timeline:
    """The stages ``request_id`` passed on a cluster started with its timeline on (the
    shared ones), once it has passed ``last``."""
    directory = Path(cluster.env[timeline.ENV_DIR])
    deadline = time.monotonic() + timeout_s
    while True:
        got = load(directory).get(request_id)
        if got is not None and last in got.at:
            return got
        assert time.monotonic() < deadline, f"{request_id} never passed {last}: {got}"
        time.sleep(0.05)
