"""The prefill group topology in the config: process indices, instance ids, ports."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig
from common.engine.config import stage_layers


def test_groups_number_processes_stage_by_stage() -> None:
    c = ClusterConfig(prefill_workers=2, prefill_stages=3, decode_workers=1)
    assert c.prefill_processes == 6
    assert [(p.instance, p.stage) for p in map(c.prefill_place, range(6))] == [
        (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert {c.prefill_place(i).head for i in (3, 4, 5)} == {3}
    assert [c.instance_id("prefill", i) for i in (0, 1, 2, 3)] == [
        "prefill-0", "prefill-0.stage1", "prefill-0.stage2", "prefill-1"]
    ports = [c.inbox("prefill", i) for i in range(6)] + [c.inbox("decode", 0)]
    assert len(set(ports)) == 7  # every process its own inbox; decode's comes after
    assert ClusterConfig().instance_id("prefill", 1) == "prefill-1"  # no groups: as before


def test_a_mixed_pool_numbers_groups_then_single_workers() -> None:
    """prefill_groups = 1 of 3 instances: one group of 2 processes, then 2 single workers
    (short prompts can skip the pipeline)."""
    c = ClusterConfig.from_dict({"prefill_workers": 3, "prefill_stages": 2,
                                 "prefill_groups": 1})
    assert c.pipeline_groups == 1 and c.prefill_processes == 4
    places = [c.prefill_place(i) for i in range(4)]
    assert [(p.instance, p.stage, p.stages, p.head) for p in places] == [
        (0, 0, 2, 0), (0, 1, 2, 0), (1, 0, 1, 2), (2, 0, 1, 3)]
    assert [c.instance_id("prefill", i) for i in range(4)] == [
        "prefill-0", "prefill-0.stage1", "prefill-1", "prefill-2"]
    none = ClusterConfig.from_dict({"prefill_workers": 2, "prefill_stages": 3,
                                    "prefill_groups": 0, "kv_layerwise": False})
    assert none.prefill_processes == 2 and none.prefill_place(1).stages == 1
    assert ClusterConfig(prefill_workers=2).pipeline_groups == 0


def test_stage_layers_split_contiguously_and_evenly() -> None:
    assert [stage_layers(30, 4, k) for k in range(4)] == [range(0, 8), range(8, 16),
                                                          range(16, 23), range(23, 30)]
    assert stage_layers(2, 1, 0) == range(0, 2)
    with pytest.raises(ValueError, match="1 to 2 stages"):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("data,match", [
    ({"prefill_stages": 0}, "positive integer"),
    ({"prefill_stages": 2, "kv_layerwise": False}, "needs kv_layerwise"),
    ({"prefill_stages": 2, "prefill_groups": 1, "kv_layerwise": False}, "needs kv_layerwise"),
    ({"prefill_stages": 2, "prefill_groups": 3, "prefill_workers": 2}, "from 0 to prefill_workers"),
    ({"prefill_stages": 2, "prefill_groups": -1}, "from 0 to prefill_workers"),
    ({"prefill_groups": 1}, "needs prefill_stages > 1"),
])
def test_bad_group_configs_are_refused(data, match) -> None:
    with pytest.raises(ValueError, match=match):
        ClusterConfig.from_dict(data)
    with pytest.raises(ValueError, match=match):  # the same checks when built in code
        ClusterConfig(**data)


@pytest.mark.parametrize("data,layerwise", [
    ({}, True),
    ({"device": "cuda"}, True),  # same-host GPU paths: chunks and launched loads
    ({"device": "cuda", "kv_path": "transfer_engine"}, False),  # all over TCP: whole blocks
    ({"device": "cuda", "transfer_protocol": "rdma"}, True),
    ({"device": "cuda", "prefill_stages": 2}, True),  # a pipeline is always layer-wise
    ({"device": "cuda", "kv_layerwise": True}, True),  # said outright: kept
])
def test_defaults_are_the_same_however_the_config_is_built(data, layerwise) -> None:
    assert ClusterConfig(**data).kv_layerwise is layerwise
    assert ClusterConfig.from_dict(data) == ClusterConfig(**data)


def test_a_removed_key_is_refused_with_what_to_do() -> None:
    with pytest.raises(ValueError, match="prefill_chunk: a cluster's workers chunk prompts "
                                         "by token_budget"):
        ClusterConfig.from_dict({"prefill_chunk": 64})


def test_kv_layerwise_defaults_off_for_gpu_kv_over_tcp_alone() -> None:
    """Left out, kv_layerwise is true except for GPU KV that only the transfer engine's TCP
    moves (one piece per layer of a block, each copied out of the GPU alone); a pipeline
    and an explicit value win."""
    def layerwise(**kw) -> bool:
        return ClusterConfig.from_dict(kw).kv_layerwise

    assert layerwise() and layerwise(device="cpu") and layerwise(device="cuda")
    te = {"kv_path": "transfer_engine"}
    assert not layerwise(device="cuda", **te)
    assert not layerwise(device="cuda:1", transfer_protocol="tcp", **te)
    assert layerwise(device="cpu", **te)
    assert layerwise(device="cuda", transfer_protocol="rdma", **te)
    assert layerwise(device="cuda", prefill_stages=2, **te)
    assert layerwise(device="cuda", kv_layerwise=True, **te)
    assert not layerwise(kv_layerwise=False)
