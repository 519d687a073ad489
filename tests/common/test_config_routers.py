"""Several routers (``routers``): each its own inbox and health port, past every other
process's, so a cluster with one router keeps its layout; bad counts are refused."""
from __future__ import annotations

import pytest

from common.config import INDEXED_ROLES, ClusterConfig
from common.health import health_port, layout


def test_the_other_routers_come_after_every_other_process() -> None:
    one = ClusterConfig(base_port=21300, prefill_workers=2, health_port=22000)
    three = ClusterConfig(base_port=21300, prefill_workers=2, health_port=22000, routers=3)
    assert three.processes("router") == 3
    assert three.inbox("router", 0) == one.inbox("router") == "tcp://127.0.0.1:21300"
    others = [(r, i) for r, i in layout(one)]
    assert [three.inbox(*p) for p in others] == [one.inbox(*p) for p in others]
    # the indexed processes from +10 on (prefill 0-1, decode 0, store node 0, colocated
    # 0: its port is kept in either mode), then routers 1 and 2
    indexed = sum(map(one.processes, INDEXED_ROLES))
    assert indexed == 5
    assert [three.inbox("router", i) for i in (1, 2)] == ["tcp://127.0.0.1:21315",
                                                         "tcp://127.0.0.1:21316"]
    inboxes = [three.inbox(*p) for p in layout(three)]
    assert len(set(inboxes)) == len(inboxes) == len(others) + 2
    assert list(layout(three))[-2:] == [("router", 1), ("router", 2)]
    assert [health_port(three, *p) for p in others] == [health_port(one, *p) for p in others]
    assert health_port(three, "router", 2) == 22000 + len(inboxes) - 1


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_router_count_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="routers must be a positive integer"):
        ClusterConfig(routers=bad)  # type: ignore[arg-type]


def test_routers_on_their_own_hosts_each_reached_at_its_own_address() -> None:
    """``[hosts] router``: one address for every router (one machine, SO_REUSEPORT), or
    one per router (a pod each behind a load balancer): each router's inbox and health
    port at its own address; a shorter list leaves the rest on ``host``."""
    pods = ["crescent-router-0.crescent-router", "crescent-router-1.crescent-router"]
    each = ClusterConfig.from_dict({"routers": 3, "base_port": 7500, "health_port": 7600,
                                    "hosts": {"router": pods}})
    assert [each.address("router", i) for i in range(3)] == [*pods, "127.0.0.1"]
    assert each.inbox("router", 0) == f"tcp://{pods[0]}:7500"
    assert each.inbox("router", 1).startswith(f"tcp://{pods[1]}:")
    assert health_port(each, "router", 1) == 7600  # alone at its address: the first port
    one = ClusterConfig.from_dict({"routers": 2, "hosts": {"router": "10.0.0.5"}})
    assert {one.address("router", i) for i in range(2)} == {"10.0.0.5"}


@pytest.mark.parametrize("hosts, message", [
    (["a", "b", "c"], "router lists 3 addresses but the cluster has 2 router"),
    ([], r"must be one address \(a non-empty string\), or a list of addresses, one per"),
    (["a", " b"], r"must be one address \(a non-empty string\), or a list of addresses"),
    (5, r"must be one address \(a non-empty string\), or a list of addresses, one per "
        r"router, not 5"),
])
def test_a_bad_router_host_list_is_refused_by_name(hosts: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict({"routers": 2, "hosts": {"router": hosts}})
