"""Per-phase precision: prefill workers compute in bfloat16, decode in float32, over one
bfloat16 KV layout; the answer is still right and the KV handover still exact in size."""
from __future__ import annotations

import pytest

from common.config import ClusterConfig
from common.worker import engine_config
from tests.e2e.conftest import start_cluster, wait_no_leaks
from tests.e2e.test_serving import PARIS, chunk_text, stream_chat

pytestmark = pytest.mark.e2e


def test_roles_get_their_dtype_and_share_one_kv_dtype() -> None:
    cfg = ClusterConfig.from_dict({"prefill_dtype": "bfloat16"})
    p, d = engine_config(cfg, "prefill"), engine_config(cfg, "decode")
    assert (p.dtype, d.dtype) == ("bfloat16", "float32")
    assert p.kv_dtype == d.kv_dtype == "float32"  # auto resolves from the cluster's dtype
    with pytest.raises(ValueError, match="prefill_dtype"):
        ClusterConfig.from_dict({"prefill_dtype": "int8"})


def test_bfloat16_prefill_float32_decode_answers_paris(tmp_path) -> None:
    cluster = start_cluster(tmp_path, http=19460, base=20100, store=False,
                            extra='prefill_dtype = "bfloat16"\nkv_dtype = "bfloat16"')
    try:
        assert "Paris" in chunk_text(stream_chat(cluster.url, PARIS, 24))
        wait_no_leaks(cluster)
    finally:
        cluster.stop()
