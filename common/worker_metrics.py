"""A worker's or store node's own ``GET /metrics`` (Prometheus text, a registry of its own),
measured in the process where the work happens:

- ``crescent_worker_step_seconds``, ``_step_sequences``, ``_step_tokens`` by ``step``: each
  engine step (``Engine.on_step``): ``prefill``, ``decode``, or ``mixed`` (a colocated step
  of both); a store node's tier commands (``offload``, ``promote``, ``replicate``);
- ``crescent_worker_kv_moved_bytes_total`` by ``flow`` (decode, hidden, store_read,
  store_write; a node's offload, promote, replicate) and ``path`` (shm, cuda_ipc, pinned,
  transfer_engine, ssd), counted where the bytes are moved;
- ``crescent_worker_transfer_errors_total`` by ``path`` and ``kind``;
- ``crescent_worker_sequences`` (running, queued) and ``crescent_worker_quarantined_blocks``,
  as of the worker's last heartbeat.

One ``WorkerMetrics`` per process (``current()``, as common/drain.py's): the code that
moves bytes, deep below the runtime, counts into it without being handed it. The listener
is prometheus-client's HTTP server in a daemon thread: a scrape reads the registry there
and never waits for the event loop, nor the loop for it.

Port (``ClusterConfig.metrics_port``): ``metrics_port + n``, n counting the processes
before it at its own address, as ``health_port`` (common/health.py): on one host each
process its own port, in Kubernetes every pod ``metrics_port``. The router, conductor and
store master serve their own metrics on their own ports (docs/services.md).
"""
from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from common.config import INDEXED_ROLES, ClusterConfig
from common.health import nth_port

STEP_BUCKETS = (0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SEQUENCE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PATH = "/metrics"


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.step_seconds = Histogram(
            "crescent_worker_step_seconds", "wall time of one engine step (a store node: one "
            "tier command)", ["step"], buckets=STEP_BUCKETS, registry=r)
        self.step_sequences = Histogram(
            "crescent_worker_step_sequences", "sequences in one step (prompt chunks and "
            "decoding sequences)", ["step"], buckets=SEQUENCE_BUCKETS, registry=r)
        self.step_tokens = Histogram(
            "crescent_worker_step_tokens", "tokens in one step (prompt tokens and one per "
            "decoding sequence)", ["step"], buckets=TOKEN_BUCKETS, registry=r)
        self.kv_bytes = Counter(
            "crescent_worker_kv_moved_bytes", "KV bytes this process moved, by flow and path",
            ["flow", "path"], registry=r)
        self.transfer_errors = Counter(
            "crescent_worker_transfer_errors", "failed copies, by path and kind",
            ["path", "kind"], registry=r)
        self.sequences = Gauge("crescent_worker_sequences", "sequences by state (running, "
                               "queued), as of the last heartbeat", ["state"], registry=r)
        self.quarantined_blocks = Gauge(
            "crescent_worker_quarantined_blocks", "decode KV blocks held until their writer's "
            "word (aborted or expired reservations a prefill may still write)", registry=r)

    def step(self, kind: str, seconds: float, sequences: int, tokens: int) -> None:
        """One step of ``kind`` took ``seconds`` (any thread; no batch: 0, 0)."""
        self.step_seconds.labels(kind).observe(seconds)
        if sequences:
            self.step_sequences.labels(kind).observe(sequences)
        if tokens:
            self.step_tokens.labels(kind).observe(tokens)

    def moved(self, flow: str, path: str, nbytes: int) -> None:
        if nbytes > 0:
            self.kv_bytes.labels(flow, path).inc(nbytes)

    def error(self, path: str, kind: str) -> None:
        self.transfer_errors.labels(path, kind).inc()

    def load(self, running: int, queued: int) -> None:
        self.sequences.labels("running").set(running)
        self.sequences.labels("queued").set(queued)

    def serve(self, host: str, port: int) -> Any:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread (port 0: a free one,
        ``server.server_port``). A port taken raises ``OSError`` (the process exits 1)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server


_current = WorkerMetrics()


def current() -> WorkerMetrics:
    """This process's metrics."""
    return _current


def metrics_port(config: ClusterConfig, role: str, index: int = 0) -> Optional[int]:
    """The ``/metrics`` port of worker or store node (role, index); None when
    ``metrics_port`` is unset or for the router, conductor and store master."""
    if role not in INDEXED_ROLES:
        return None
    return nth_port(config, config.metrics_port, role, index)


def serve(config: ClusterConfig, role: str, index: int) -> Optional[Any]:
    """Start this process's listener when the config asks for one; returns its server
    (``shutdown()`` it at the end) or None."""
    port = metrics_port(config, role, index)
    if port is None:
        return None
    return current().serve(config.listen_host(role, index), port)


def stop(server: Optional[Any]) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def worker_processes(config: ClusterConfig) -> list[tuple[str, int]]:
    """(role, index) of every process of the cluster that serves these metrics (as
    ``crescent up`` starts them: launch/cluster.py ``LocalCluster.plan``)."""
    nodes = [("store_node", i) for i in range(config.store.nodes)] if config.store.enabled \
        else []
    if config.mode == "colocated":
        return [("colocated", i) for i in range(config.colocated_workers)] + nodes
    return ([("prefill", i) for i in range(config.prefill_processes)]
            + [("decode", i) for i in range(config.decode_workers)] + nodes)
