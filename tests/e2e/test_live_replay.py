"""A short live replay: AIPerf drives a real default-shape cluster through the same code
path as benchmarks/live_replay.py, and every request must complete."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from benchmarks.live_replay import (
    cluster_config_data, export_tokenizer, find_aiperf, run_aiperf, to_toml,
)
from benchmarks.replay_metrics import conversation_slice, scale_trace
from launch import forkserver
from launch.cluster import LocalCluster
from traces.loader import default_trace_path

pytestmark = pytest.mark.e2e
HTTP_PORT = 24100  # the cluster's inboxes take 24110 and up
REQUESTS = 8
RATE = 2.0


def test_short_live_replay_has_no_failed_requests(tmp_path: Path) -> None:
    aiperf = find_aiperf(install=False)
    if aiperf is None:
        pytest.skip("aiperf is not installed: run benchmarks/live_replay.py once (it creates "
                    ".venv-bench) or install the `bench` extra in a venv of its own")
    trace_file = default_trace_path()
    if not trace_file.is_file():
        pytest.skip(f"no trace at {trace_file}")
    with open(trace_file) as fh:
        rows = conversation_slice([json.loads(line) for line in fh if line.strip()], REQUESTS)
    trace = scale_trace(rows, RATE, seed=0, max_output=16)
    trace_path = tmp_path / "trace.jsonl"
    trace_path.write_text("".join(json.dumps(r) + "\n" for r in trace))

    data = cluster_config_data("disagg-store", HTTP_PORT)
    assert (data["http_port"], data["base_port"]) == (24100, 24110)
    cfg = tmp_path / "cluster.toml"
    cfg.write_text(to_toml(data))
    cluster = LocalCluster(str(cfg), tmp_path / "logs", forkserver=forkserver.shared())
    tok = export_tokenizer(cluster.config.model, cluster.config.model_name, tmp_path / "tok")
    try:
        cluster.start(timeout_s=180)
        results = run_aiperf(aiperf, cluster.url, cluster.config.model_name, trace_path, tok,
                             tmp_path / "aiperf", seed=0, request_timeout_s=120,
                             extra_inputs=("temperature:0",))
        c = cluster.config
        ttft = httpx.get(f"http://{c.address('conductor')}:{c.port('conductor_http')}"
                         "/debug/ttft", timeout=10).json()
    finally:
        cluster.stop()

    failed = [r for r in results if not r.ok]
    assert len(results) == REQUESTS
    assert not failed, f"failed requests: {failed}; logs in {tmp_path}"
    for r in results:
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.output_tokens >= 1
    # the default config's cost profile is "auto": each worker's phase fitted on this
    # machine (at its first start here, or from the cache) prices the predictions
    assert ttft["cost"]["profile"] == "auto"
    phases = sorted(json.loads(k)["phase"] for k in ttft["cost"]["machine_keys"])
    assert phases == ["decode", "prefill"], ttft["cost"]
    assert ttft["summary"]["count"] == REQUESTS
