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
