"""The prefill group topology in the config: process indices, instance ids, ports."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig
from common.engine.config import stage_layers


def test_groups_number_processes_stage_by_stage() -> None:
    c = ClusterConfig(prefill_workers=2, prefill_stages=3, decode_workers=1)
    assert c.prefill_processes == 6
    assert [c.prefill_stage(i) for i in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1),
                                                      (1, 2)]
    assert [c.instance_id("prefill", i) for i in (0, 1, 2, 3)] == [
        "prefill-0", "prefill-0.stage1", "prefill-0.stage2", "prefill-1"]
    ports = [c.inbox("prefill", i) for i in range(6)] + [c.inbox("decode", 0)]
    assert len(set(ports)) == 7  # every process its own inbox; decode's comes after
    assert ClusterConfig().instance_id("prefill", 1) == "prefill-1"  # no groups: as before


def test_stage_layers_split_contiguously_and_evenly() -> None:
    assert [stage_layers(30, 4, k) for k in range(4)] == [range(0, 8), range(8, 16),
                                                          range(16, 23), range(23, 30)]
    assert stage_layers(2, 1, 0) == range(0, 2)
    with pytest.raises(ValueError, match="1 to 2 stages"):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("data,match", [
    ({"prefill_stages": 0}, "positive integer"),
    ({"prefill_stages": 2, "kv_layerwise": False}, "needs kv_layerwise"),
])
def test_bad_group_configs_are_refused(data, match) -> None:
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict(data)
