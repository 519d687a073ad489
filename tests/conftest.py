"""Fixtures shared by several test packages."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import pytest

from common.transfer import TransferAgent

if TYPE_CHECKING:
    from common.engine import Engine


TESTS = Path(__file__).parent
# On N xdist workers (``make test TEST_WORKERS=N``) each worker's torch gets its share of
# the cores: two OpenMP teams spinning on the same two cores (and the clusters' workers
# beside them) made in-process model tests 4-5x slower. Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _share = len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _share)))
# Packages whose modules share one set-up (tests/multihost: the network namespaces and
# the package's clusters on fixed addresses).
ONE_GROUP_PACKAGES = ("multihost",)
# The e2e modules whose tests share the package's clusters (tests/e2e/conftest.py
# ``shared``), by the group they run in. A group boots the shapes its tests ask for, on
# ports of its own, so two groups run on two workers at once; the tests on the shapes of
# ``OTHER_SHAPES`` (named by their test ids) make a group of their own.
# ``pytest_collection_modifyitems`` refuses a module that uses the clusters unlisted.
SHARED_CLUSTER_GROUPS = {
    "e2e-shared-requests": ("e2e/test_api_fields.py", "e2e/test_choices.py",
                            "e2e/test_echo.py", "e2e/test_kv_pool.py", "e2e/test_serving.py",
                            "e2e/test_top_logprobs.py", "e2e/test_worker_metrics_e2e.py"),
    "e2e-shared-grammars": ("e2e/test_structured_outputs.py", "e2e/test_tools.py",
                            "e2e/test_lora_serving.py"),
    "e2e-shared-shapes": ("e2e/test_colocated.py",),
}
SHARED_CLUSTER_MODULES = tuple(m for group in SHARED_CLUSTER_GROUPS.values() for m in group)
OTHER_SHAPES = ("pipeline", "colocated")


def xdist_group(nodeid: str) -> str:
    """The tests that run whole on one xdist worker (``make test TEST_WORKERS=N``): a module
    (its module-scoped clusters and its fixed ports are its own), a group of the modules
    sharing the e2e package's clusters, a package of ``ONE_GROUP_PACKAGES``."""
    path, _, name = nodeid.partition("::")
    path = path.removeprefix("tests/")
    if path.split("/", 1)[0] in ONE_GROUP_PACKAGES:
        return path.split("/", 1)[0]
    for group, modules in SHARED_CLUSTER_GROUPS.items():
        if path in modules:
            ids = set(name.partition("[")[2].rstrip("]").split("-"))
            return "e2e-shared-shapes" if ids & set(OTHER_SHAPES) else group
    return path


# The longest groups on the CI box (2 cores), longest first: a worker starts them first,
# and the short ones fill the other worker's time at the end (xdist's own order, most
# tests first, left a worker idle for a minute while the other ran a late long group).
LONGEST_GROUPS = ("e2e/test_pipeline.py", "e2e-shared-requests", "e2e-shared-grammars",
                  "e2e-shared-shapes",
                  "launch/test_supervise_cluster.py", "multihost", "faults/test_faults.py",
                  "faults/test_pipeline_faults.py", "e2e/test_kv_path.py",
                  "model/test_smollm2.py", "model/test_triton_ops.py", "e2e/test_dashboard.py")


def run_order(group: str, e2e: bool, first_seen: int) -> tuple[int, int]:
    """Where a group runs: the longest (``LONGEST_GROUPS``), then the other groups that
    boot clusters, then the rest, each in collection order."""
    if group in LONGEST_GROUPS:
        return 0, LONGEST_GROUPS.index(group)
    return (1 if e2e else 2), first_seen


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    config.option.loadscopereorder = False  # the groups run in collection order: run_order
    return ByGroup(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Refuse a module that uses the shared clusters unlisted; then run each group's tests
    as one block, the groups in ``run_order``, so a group's clusters are booted once and
    stopped when it ends (tests/e2e/conftest.py ``SharedClusters``)."""
    for item in items:
        path = Path(str(item.fspath)).relative_to(TESTS).as_posix()
        if "shared" in getattr(item, "fixturenames", ()) and path not in \
                SHARED_CLUSTER_MODULES:
            raise pytest.UsageError(f"{path} uses the e2e package's shared clusters: list "
                                    f"it in tests/conftest.py SHARED_CLUSTER_MODULES")
    first: dict[str, int] = {}
    e2e: set[str] = set()
    for i, item in enumerate(items):
        group = xdist_group(item.nodeid)
        first.setdefault(group, i)
        if item.get_closest_marker("e2e") is not None:
            e2e.add(group)
    order = {g: run_order(g, g in e2e, i) for g, i in first.items()}
    items.sort(key=lambda item: order[xdist_group(item.nodeid)])  # stable: order kept within


@pytest.fixture(scope="module")
def _engines() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    a, b = TransferAgent(), TransferAgent()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def agents(_engines: tuple[TransferAgent, TransferAgent]
           ) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """Two real transfer engines (TCP on loopback): a local and a remote side, shared by
    a module; what a test registered is unregistered after it (a later test's tensor may
    reuse the addresses, and the engine refuses overlapping regions)."""
    yield _engines
    for agent in _engines:
        for address in agent.registered():
            agent.unregister(address)


@pytest.fixture(scope="session")
def smol() -> "Engine":
    """The default model (SmolLM2-135M-Instruct, float32, CPU), shared by the session."""
    from common.engine import Engine, EngineConfig

    return Engine(EngineConfig(num_blocks=256, prefill_chunk=512))


@pytest.fixture
def tiny() -> "Engine":
    """A dummy model with random weights and 4-token blocks: fast, for KV bookkeeping."""
    from common.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="dummy-tiny", num_blocks=64, block_size=4,
                               prefill_chunk=512))
