"""A worker's own /metrics (common/worker_metrics.py): what each hook records, the port
scheme, the processes that serve it, and the listener itself."""
from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from common.config import ClusterConfig, HostsConfig
from common.engine import DecodeInput, Engine
from common.engine.config import PrefillChunk
from common.metric_values import by_label, samples
from common.worker_metrics import WorkerMetrics, metrics_port, worker_processes

REPO = Path(__file__).resolve().parents[2]


def test_steps_bytes_errors_and_load_land_in_their_series() -> None:
    m = WorkerMetrics()
    m.step("decode", 0.02, 3, 3)
    m.step("decode", 0.03, 5, 5)
    m.step("prefill", 0.4, 2, 300)
    m.step("offload", 0.001, 0, 0)  # a store command: no batch
    assert by_label(m.step_seconds, "step", "_count") == {"decode": 2, "prefill": 1,
                                                          "offload": 1}
    assert by_label(m.step_sequences, "step", "_sum") == {"decode": 8, "prefill": 2}
    assert by_label(m.step_tokens, "step", "_sum") == {"decode": 8, "prefill": 300}
    m.moved("decode", "shm", 4096)
    m.moved("decode", "shm", 4096)
    m.moved("store_read", "transfer_engine", 100)
    m.moved("store_write", "shm", 0)  # nothing moved: no series
    assert {(s["flow"], s["path"]): v for s, v in samples(m.kv_bytes)} == {
        ("decode", "shm"): 8192, ("store_read", "transfer_engine"): 100}
    m.error("transfer_engine", "decode")
    m.error("store", "range_copy")
    m.error("store", "range_copy")
    assert by_label(m.transfer_errors, "kind") == {"decode": 1, "range_copy": 2}
    m.load(running=4, queued=1)
    m.quarantined_blocks.set(6)
    assert by_label(m.sequences, "state", "") == {"running": 4, "queued": 1}
    assert samples(m.quarantined_blocks, "") == [({}, 6)]


def test_the_listener_serves_prometheus_text_off_the_event_loop() -> None:
    m = WorkerMetrics()
    m.moved("decode", "shm", 10)
    server = m.serve("127.0.0.1", 0)
    try:
        reply = httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith(
            "text/plain")
        assert 'crescent_worker_kv_moved_bytes_total{flow="decode",path="shm"} 10.0' in \
            reply.text
    finally:
        server.shutdown()
        server.server_close()


def test_ports_follow_the_health_port_rule_for_workers_and_store_nodes_only() -> None:
    assert metrics_port(ClusterConfig(), "decode") is None  # unset: no listener
    c = ClusterConfig(metrics_port=7700, prefill_workers=2)
    # router, conductor, store master, prefill 0-1, decode 0, store node 0, colocated 0
    assert [metrics_port(c, r, i) for r, i in [("prefill", 0), ("prefill", 1), ("decode", 0),
                                               ("store_node", 0), ("colocated", 0)]] == \
        [7703, 7704, 7705, 7706, 7707]
    assert {metrics_port(c, r) for r in ("router", "conductor", "store_master")} == {None}
    assert max(metrics_port(c, *p) for p in worker_processes(c)) < 7700 + 10
    spread = ClusterConfig(metrics_port=7700, hosts=HostsConfig(
        prefill=["p0"], decode=["d0"], store_node=["s0"]))  # one host each (Kubernetes)
    assert {metrics_port(spread, *p) for p in worker_processes(spread)} == {7700}


def test_the_shipped_configs_give_every_worker_its_own_port() -> None:
    for name in ("default", "compose", "k8s"):
        c = ClusterConfig.load(str(REPO / "launch" / "configs" / f"{name}.toml"))
        ports = {(c.address(*p), metrics_port(c, *p)) for p in worker_processes(c)}
        assert len(ports) == len(worker_processes(c)) and None not in {p for _, p in ports}
        taken = {c.http_port, c.base_port + 10, c.health_port} | {
            c.port(n) for n in ("router", "conductor", "store_master", "conductor_http",
                                "store_master_http", "store_events")}
        assert not {p for _, p in ports} & taken, name


def test_worker_processes_are_those_the_cluster_starts() -> None:
    assert worker_processes(ClusterConfig(prefill_workers=2, prefill_stages=2)) == [
        ("prefill", 0), ("prefill", 1), ("prefill", 2), ("prefill", 3), ("decode", 0),
        ("store_node", 0)]
    assert worker_processes(ClusterConfig(mode="colocated", colocated_workers=2)) == [
        ("colocated", 0), ("colocated", 1), ("store_node", 0)]
    off = ClusterConfig.from_dict({"store": {"enabled": False}})
    assert worker_processes(off) == [("prefill", 0), ("decode", 0)]


def test_the_engine_reports_each_step_by_kind(tiny: Engine) -> None:
    steps: list[tuple[str, int, int]] = []
    tiny.on_step = lambda kind, seconds, seqs, tokens: steps.append((kind, seqs, tokens))
    blocks = tiny.pool.allocate(5)
    prompt = list(range(1, 11))
    tiny.stage_step([PrefillChunk(prompt, 0, 6, blocks[:2])])
    tiny.step([PrefillChunk(prompt, 6, 10, blocks[:3])], [DecodeInput(5, 3, blocks[3:])])
    tiny.decode_step([DecodeInput(7, 10, blocks[:3]), DecodeInput(6, 4, blocks[3:])])
    assert steps == [("prefill", 1, 6), ("mixed", 2, 5), ("decode", 2, 2)]
    with pytest.raises(Exception):
        tiny.decode_step([])  # refused: not a step
    assert len(steps) == 3
