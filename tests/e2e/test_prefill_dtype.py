"""Per-phase precision: prefill workers compute in bfloat16, decode in float32, over one
bfloat16 KV layout; the answer is still right and the KV handover still exact in size."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from common import worker
from common.config import ClusterConfig
from common.worker import engine_config
from tests.e2e.conftest import start_cluster, wait_no_leaks
from tests.e2e.test_serving import PARIS, chunk_text, stream_chat

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def test_roles_get_their_dtype_and_share_one_kv_dtype() -> None:
    cfg = ClusterConfig.from_dict({"prefill_dtype": "bfloat16"})
    p, d = engine_config(cfg, "prefill"), engine_config(cfg, "decode")
    assert (p.dtype, d.dtype) == ("bfloat16", "float32")
    assert p.kv_dtype == d.kv_dtype == "float32"  # auto resolves from the cluster's dtype
    with pytest.raises(ValueError, match="prefill_dtype"):
        ClusterConfig.from_dict({"prefill_dtype": "int4"})


@pytest.mark.parametrize("native", [True, False])
def test_auto_prefills_in_bfloat16_only_where_the_cpu_has_it(monkeypatch, native) -> None:
    monkeypatch.setattr(worker, "native_bfloat16", lambda: native)
    cfg = ClusterConfig.from_dict({"prefill_dtype": "auto", "kv_dtype": "bfloat16"})
    p, d = engine_config(cfg, "prefill"), engine_config(cfg, "decode")
    assert (p.dtype, d.dtype) == ("bfloat16" if native else "float32", "float32")
    assert p.kv_dtype == d.kv_dtype == "bfloat16"
    on_gpu = ClusterConfig.from_dict({"prefill_dtype": "auto", "device": "cuda",
                                      "dtype": "float16"})
    assert engine_config(on_gpu, "prefill").dtype == "float16"  # a GPU: the cluster's dtype


def test_the_default_cluster_prefills_auto() -> None:
    with open(REPO / "launch" / "configs" / "default.toml", "rb") as fh:
        assert tomllib.load(fh)["prefill_dtype"] == "auto"


def test_bfloat16_prefill_float32_decode_answers_paris(tmp_path) -> None:
    cluster = start_cluster(tmp_path, http=19460, base=20100, store=False,
                            extra='prefill_dtype = "bfloat16"\nkv_dtype = "bfloat16"')
    try:
        assert "Paris" in chunk_text(stream_chat(cluster.url, PARIS, 24))
        wait_no_leaks(cluster)
    finally:
        cluster.stop()


def test_int8_linears_in_both_roles_answer_as_one_engine(tmp_path) -> None:
    """The default model's Q4_1 codes times int8 inputs on both workers
    (csrc/linear_int8.c): the answer of one engine computing the same way, token for
    token (not "Paris": rounding the inputs to int8 turns this answer; BENCHMARKS.md,
    "quantized linears")."""
    from dataclasses import replace

    from common.engine import Engine, SamplingParams, generate

    cluster = start_cluster(tmp_path, http=19470, base=20130, store=False,
                            extra='prefill_dtype = "int8"\nlinear_dtype = "int8"')
    try:
        text = chunk_text(stream_chat(cluster.url, PARIS, 24))
        wait_no_leaks(cluster)
    finally:
        cluster.stop()
    # the prefill worker's engine (its chunks' alignment, KV dtype): the decode worker's
    # computes the same way
    config = engine_config(ClusterConfig(prefill_dtype="int8", linear_dtype="int8"), "prefill")
    assert (config.dtype, config.linear_dtype) == ("float32", "int8")
    engine = Engine(replace(config, num_blocks=64))
    want = generate(engine, engine.apply_chat_template(PARIS),
                    SamplingParams(max_tokens=24, temperature=0.0)).text
    assert text == want and text
