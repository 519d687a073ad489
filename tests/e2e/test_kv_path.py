"""Prefill → decode KV over shared memory vs over the transfer engine, on real clusters:
greedy outputs are identical, the shared-memory path is the one used, and its segments
are gone after the cluster stops."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from launch import forkserver
from launch.cluster import LocalCluster

pytestmark = pytest.mark.e2e
HTTP, BASE = 24000, 24010

CONFIG = """
model = "smollm2-135m"
http_port = {http}
base_port = {base}
prefill_workers = 1
decode_workers = 1
prefill_blocks = 256
decode_blocks = 512
heartbeat_interval_s = 0.2
kv_path = "{kv_path}"
kv_dtype = "{kv_dtype}"
cost_profile = "cpu-smollm2-135m"  # no calibration (tests/e2e/conftest.py)

[store]
segment_bytes = 67108864

[slo]
ttft_s = 120.0
tbt_s = 30.0

[cpu]
affinity = false  # tests/e2e/conftest.py start_cluster: why
"""

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman "
         "who knew every wave and every wind. ") * 20  # ~490 tokens: many chunks, 31 blocks


def _completion(url: str, prompt: str, max_tokens: int) -> tuple[str, int]:
    r = httpx.post(url + "/v1/completions", json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0}, timeout=180)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens"]


def _chat(url: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", json={
        "model": "smollm2-135m", "messages": PARIS, "max_tokens": max_tokens,
        "temperature": 0}, timeout=180)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _serve(tmp: Path, kv_path: str, kv_dtype: str = "auto") -> tuple[list[str], str]:
    """Run the prompts on a fresh cluster; its outputs and its prefill worker's log."""
    name = f"{kv_path}-{kv_dtype}"
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(http=HTTP, base=BASE, kv_path=kv_path, kv_dtype=kv_dtype))
    cluster = LocalCluster(str(cfg), tmp / f"logs-{name}", forkserver=forkserver.shared())
    try:
        cluster.start(timeout_s=180)
        story, n = _completion(cluster.url, STORY, 12)
        assert n > 400
        # Same prefix again, longer: its first blocks come from the prefill worker's cache
        # and travel as whole blocks; the rest layer by layer.
        story2, _ = _completion(cluster.url, STORY + " The fisherman said", 12)
        outputs = [_chat(cluster.url, 16), story, story2]
    finally:
        cluster.stop()
    return outputs, (tmp / f"logs-{name}" / "prefill-0.log").read_text(errors="replace")


def test_shm_and_transfer_engine_paths_give_identical_greedy_outputs(tmp_path: Path) -> None:
    shm_out, shm_log = _serve(tmp_path, "shm")
    te_out, te_log = _serve(tmp_path, "transfer_engine")
    assert "Paris" in shm_out[0]
    assert shm_out == te_out
    # Which path each cluster took, from the prefill worker's own account.
    assert "first KV stream via shm" in shm_log
    assert "first KV stream via transfer_engine" not in shm_log
    assert "first KV stream via transfer_engine" in te_log
    assert "via shm" not in te_log
    mapped = re.search(r"over shared memory \((/dev/shm/crescent-kv-\S+-decode-0-\d+),", shm_log)
    assert mapped is not None, shm_log[-2000:]
    assert not Path(mapped.group(1)).exists()  # the decode worker unlinked it on stop


def test_bfloat16_kv_across_processes(tmp_path: Path) -> None:
    """Half the bytes per block through the shm path, the prefix cache and the store."""
    out, log = _serve(tmp_path, "auto", "bfloat16")
    assert "Paris" in out[0]
    assert all(text.strip() for text in out[1:])
    streamed = re.search(r"first KV stream via shm: (\d+) bytes", log)
    assert streamed is not None, log[-2000:]
    # STORY is 33 blocks; a bfloat16 block is 30 layers x (K, V) x 16 x 3 heads x 64 x 2 bytes
    # (the float32 run streams 24,330,240 bytes for it).
    assert int(streamed.group(1)) == 33 * 30 * 2 * 16 * 3 * 64 * 2
