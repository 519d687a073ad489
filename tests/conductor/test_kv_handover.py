"""What the conductor hands the prefill worker about the decode worker's KV memory: its
shared-memory file and host id; and a refusal when the two KV layouts differ."""
from __future__ import annotations

import time
from typing import Any

from common.config import ClusterConfig, SLOConfig
from common.kv.events import KVEvents
from common.protocol import (
    AbortRequest, BlocksReserved, PrefillTask, RegisterWorker, RequestFailed, SubmitRequest,
    WorkerHeartbeat, WorkerLoad,
)
from common.status_protocol import ClusterStatus
from common.sampling_params import SamplingParams
from services.conductor.service import Conductor


class Mail:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    def send(self, address: str, msg: Any) -> bool:
        if not isinstance(msg, ClusterStatus):
            self.sent.append((address, msg))
        return True


def register(role: str, block_nbytes: int = 1024, **extra: Any) -> RegisterWorker:
    return RegisterWorker(f"{role}-0", role, f"tcp://w/{role}", "h:1", 4096, block_nbytes,
                          block_nbytes // 32, 100, 16, **extra)


def cluster(prefill: RegisterWorker, decode: RegisterWorker) -> tuple[Conductor, Mail]:
    mail = Mail()
    c = Conductor(ClusterConfig(slo=SLOConfig(ttft_s=1000, tbt_s=1000)), mail)  # type: ignore[arg-type]
    for msg in (prefill, decode):
        c.on_register(msg)
        c.on_heartbeat(WorkerHeartbeat(msg.instance_id, msg.role, WorkerLoad(), 100, 0, 100,
                                       KVEvents(), 0))
    c.on_submit(SubmitRequest("r1", list(range(40)), [], SamplingParams(max_tokens=8), time.time()))
    c.on_reserved(BlocksReserved("r1", "decode-0", [5, 6, 7]))
    return c, mail


def test_prefill_task_carries_the_decode_segment_and_host() -> None:
    decode = register("decode", kv_shm_path="/dev/shm/crescent-kv-h-decode-0-42",
                      host_id="h/boot")
    c, mail = cluster(register("prefill"), decode)
    [task] = [m for _, m in mail.sent if isinstance(m, PrefillTask)]
    assert (task.decode_shm_path, task.decode_host_id) == ("/dev/shm/crescent-kv-h-decode-0-42",
                                                           "h/boot")
    # A worker that advertises nothing (an older one, or kv_path = "transfer_engine").
    c, mail = cluster(register("prefill"), register("decode"))
    [task] = [m for _, m in mail.sent if isinstance(m, PrefillTask)]
    assert task.decode_shm_path is None and task.decode_host_id is None


def test_different_kv_layouts_fail_the_request_and_free_the_reservation() -> None:
    c, mail = cluster(register("prefill", block_nbytes=2048), register("decode"))
    assert not [m for _, m in mail.sent if isinstance(m, PrefillTask)]
    [failed] = [m for _, m in mail.sent if isinstance(m, RequestFailed)]
    assert (failed.status, failed.error_type) == (500, "kv_layout_mismatch")
    assert "prefill-0 writes 2048-byte KV blocks, decode-0 holds 1024-byte ones" in failed.message
    aborted = sorted(a for a, m in mail.sent if isinstance(m, AbortRequest))
    assert aborted == ["tcp://w/decode", "tcp://w/prefill"]  # the decode frees its blocks
    assert c.tracker.requests == {}
