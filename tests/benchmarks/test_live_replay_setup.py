"""The benchmark's setup steps that need no cluster: config files and the tokenizer."""
from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from benchmarks.live_replay import (
    CONFIGS, ReplayError, cluster_config_data, export_tokenizer, to_toml,
)
from common.config import ClusterConfig


def test_configs_are_default_toml_plus_overrides_and_ports() -> None:
    store = cluster_config_data("disagg-store", 19800)
    nostore = cluster_config_data("disagg-nostore", 19800)
    assert (store["http_port"], store["base_port"]) == (19800, 19810)
    assert store["scheduler"] == "kvcache_centric" and store["slo"]["ttft_s"] == 30.0
    assert nostore == {**store, "store": {"enabled": False}}
    assert tomllib.loads(to_toml(store)) == store
    assert ClusterConfig.from_dict(tomllib.loads(to_toml(nostore))).store.enabled is False


def test_colocated_fails_clearly_where_the_mode_is_missing() -> None:
    if "mode" in {f.name for f in dataclasses.fields(ClusterConfig)}:
        assert cluster_config_data("colocated", 19800)["mode"] == "colocated"
    else:
        with pytest.raises(ReplayError, match="not supported by this checkout"):
            cluster_config_data("colocated", 19800)
    with pytest.raises(ReplayError, match="unknown configuration"):
        cluster_config_data("nonesuch", 19800)
    assert set(CONFIGS) == {"disagg-store", "disagg-nostore", "colocated", "disagg-variant",
                            "disagg-arrival", "disagg-nopreempt", "disagg-int8"}
    assert cluster_config_data("disagg-variant", 19800)["batch_invariant"] is False
    assert cluster_config_data("disagg-arrival", 19800)["prefill_order"] == "arrival"
    int8 = cluster_config_data("disagg-int8", 19800)
    assert (int8["linear_dtype"], int8["prefill_dtype"]) == ("int8", "int8")


def test_exported_tokenizer_loads_offline_and_matches_the_router(tmp_path: Path,
                                                                 monkeypatch) -> None:
    from transformers import AutoTokenizer

    from services.router.tokenizer import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = export_tokenizer("smollm2-135m", "smollm2-135m", tmp_path)
    assert tok.repo_id == "crescent/smollm2-135m"
    entry = tok.hub_cache / "models--crescent--smollm2-135m"
    rev = (entry / "refs" / "main").read_text()
    snapshot = entry / "snapshots" / rev
    assert sorted(p.name for p in snapshot.iterdir()) == ["tokenizer.json",
                                                          "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(str(snapshot))
    ours = load_tokenizer("smollm2-135m")
    text = "The capital of France is Paris. 123 + 456 = 579"
    assert hf.encode(text) == ours.encode_text(text)
    messages = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.tokenizer.render_chat(messages)
    again = export_tokenizer("smollm2-135m", "smollm2-135m", tmp_path)
    assert (again.hub_cache / "models--crescent--smollm2-135m" / "refs" / "main").read_text() == rev
