"""A config key typed as a scalar holds one of its types, or the config fails naming it
(common/config_load.py): ``base_port = "8000"`` used to start every process and crash
the first one that added to it, with a TypeError."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig
from common.service import parse_overrides


@pytest.mark.parametrize("data, message", [
    ({"base_port": "8000"}, "config key base_port must be an integer, not '8000'"),
    ({"store": {"segment_bytes": 1.5}}, "store.segment_bytes must be an integer, not 1.5"),
    ({"store": {"enabled": "yes"}}, "store.enabled must be true or false, not 'yes'"),
    ({"cpu": {"affinity": 1}}, "cpu.affinity must be true or false, not 1"),
    ({"http_port": True}, "http_port must be an integer, not True"),
    ({"served_model_name": 16}, "served_model_name must be a string, not 16"),
    (parse_overrides(["base_port=abc"]), "base_port must be an integer, not 'abc'"),
])
def test_a_value_of_the_wrong_type_names_its_key(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict(data)


def test_numbers_and_optional_keys_take_what_they_should() -> None:
    c = ClusterConfig.from_dict({"heartbeat_interval_s": 1, "prefill_dtype": None,
                                 "cpu": {"decode_threads": 2}, "store": {"enabled": False}})
    assert c.heartbeat_interval_s == 1 and c.prefill_dtype is None
    assert c.cpu.decode_threads == 2 and c.store.enabled is False


@pytest.mark.parametrize("modules, message", [
    (["sql=/a"], "must map adapter names to directories"),
    ({"sql": 3}, "must map adapter names to directories"),
    ({"sql": ""}, "must map adapter names to directories"),
    ({"a b": "/a"}, "LoRA adapter name 'a b'"),
    ({"smollm2-135m": "/a"}, "other than the served model's name 'smollm2-135m'"),
])
def test_lora_modules_name_adapters_and_their_directories(modules, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ClusterConfig.from_dict({"lora_modules": modules})


def test_lora_modules_are_served_after_the_model() -> None:
    config = ClusterConfig.from_dict(parse_overrides(["lora_modules.sql=/a/sql"]))
    assert config.lora_modules == {"sql": "/a/sql"}
    assert config.served_names == ("smollm2-135m", "sql")
