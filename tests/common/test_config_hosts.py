"""The [hosts] table and bind_host: every process's advertised and bound addresses."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig

THREE_HOSTS = {
    "prefill_workers": 2, "decode_workers": 1, "store": {"nodes": 2},
    "hosts": {"router": "10.77.0.1", "conductor": "10.77.0.1", "store_master": "10.77.0.1",
              "prefill": ["10.77.0.2"], "decode": ["node-3.svc"],
              "store_node": ["10.77.0.2", "10.77.0.3"]},
}


def test_every_process_gets_its_own_address_or_host() -> None:
    c = ClusterConfig.from_dict(dict(THREE_HOSTS, base_port=21300))
    assert [c.address(r) for r in ("router", "conductor", "store_master")] == ["10.77.0.1"] * 3
    assert (c.address("prefill", 0), c.address("prefill", 1)) == ("10.77.0.2", "127.0.0.1")
    assert c.address("decode") == "node-3.svc"  # DNS names allowed
    assert [c.address("store_node", i) for i in (0, 1)] == ["10.77.0.2", "10.77.0.3"]
    assert c.address("colocated", 0) == "127.0.0.1"  # not listed: host
    # inboxes: the process's address, the port layout unchanged by [hosts]
    assert c.inbox("router") == "tcp://10.77.0.1:21300"
    assert c.inbox("prefill", 0) == "tcp://10.77.0.2:21310"
    assert c.inbox("prefill", 1) == "tcp://127.0.0.1:21311"
    assert c.inbox("decode", 0) == "tcp://node-3.svc:21312"
    assert c.inbox("store_node", 1) == "tcp://10.77.0.3:21314"
    assert c.store_events_address == "tcp://10.77.0.1:21305"


def test_bind_host_moves_listeners_not_advertised_addresses() -> None:
    own = ClusterConfig.from_dict(THREE_HOSTS)
    assert own.listen_host("decode") == "node-3.svc"  # "": each binds its own address
    assert own.inbox("decode", 0, bind=True) == own.inbox("decode", 0)
    c = ClusterConfig.from_dict(dict(THREE_HOSTS, bind_host="0.0.0.0", base_port=21300))
    assert c.listen_host("router") == c.listen_host("store_node", 1) == "0.0.0.0"
    assert c.inbox("decode", 0, bind=True) == "tcp://0.0.0.0:21312"
    assert c.inbox("decode", 0) == "tcp://node-3.svc:21312"
    assert c.store_events(bind=True) == "tcp://0.0.0.0:21305"
    assert c.store_events_address == "tcp://10.77.0.1:21305"


def test_no_hosts_table_is_the_single_host_layout() -> None:
    c = ClusterConfig.from_dict({"host": "10.0.0.9", "base_port": 21300})
    assert c.address("router") == c.address("decode", 0) == c.listen_host("prefill") == "10.0.0.9"
    assert c.inbox("prefill", 0) == "tcp://10.0.0.9:21310"
    assert c.inbox("decode", 0) == "tcp://10.0.0.9:21311"


def test_prefill_addresses_follow_process_indices_of_pipeline_groups() -> None:
    c = ClusterConfig.from_dict({"prefill_workers": 2, "prefill_stages": 2, "hosts": {
        "prefill": ["a", "a", "b", "b"]}})
    assert [c.address("prefill", i) for i in range(4)] == ["a", "a", "b", "b"]


@pytest.mark.parametrize("data,message", [
    ({"hosts": {"prefil": ["a"]}}, r"unknown config keys in \[hosts\]: \['prefil'\]"),
    ({"hosts": {"decode": ["a", "b"]}},
     r"\[hosts\] decode lists 2 addresses but the cluster has 1 decode process"),
    ({"store": {"nodes": 1}, "hosts": {"store_node": ["a", "b", "c"]}},
     r"\[hosts\] store_node lists 3 addresses but the cluster has 1 store_node"),
    ({"hosts": {"router": ["a", "b"]}},
     r"\[hosts\] router lists 2 addresses but the cluster has 1 router process"),
    ({"hosts": {"store_master": ["a"]}}, r"\[hosts\] store_master must be one address"),
    ({"hosts": {"conductor": ""}}, r"\[hosts\] conductor must be one address"),
    ({"hosts": {"prefill": "a"}}, r"\[hosts\] prefill must be a list of addresses"),
    ({"hosts": {"decode": [" a"]}}, r"\[hosts\] decode must be a list of addresses"),
    ({"hosts": {"decode": [3]}}, r"\[hosts\] decode must be a list of addresses"),
    ({"hosts": "10.0.0.1"}, r"\[hosts\] must be a table"),
    ({"bind_host": 0}, r"bind_host must be an address"),
    ({"host": ""}, r"host must be an address"),
])
def test_bad_hosts_configs_name_the_key(data, message) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


def test_unknown_role_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown role 'gateway'"):
        ClusterConfig().address("gateway")
    with pytest.raises(ValueError, match="unknown role 'gateway'"):
        ClusterConfig().inbox("gateway")


def test_hosts_survive_a_dict_round_trip() -> None:
    c = ClusterConfig.from_dict(THREE_HOSTS)
    assert ClusterConfig.from_dict(c.to_dict()).hosts == c.hosts
