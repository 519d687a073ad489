"""What prefill and decode workers share: the engine, the transfer agent over the paged
KV memory, registration with the conductor, and heartbeats carrying load and KV events."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from typing import Callable, Optional

import torch

from common.config import ClusterConfig
from common.engine import Engine, EngineConfig
from common.kv.events import BlockStored
from common.kv.memory import resolve_kv_dtype
from common.kv.shm_kv import close_at_exit, host_id, worker_segment
from common.mailbox import Mailbox
from common.protocol import RegisterWorker, RequestFailed, WorkerHeartbeat, WorkerLoad
from common.sampling_params import SamplingParams
from common.transfer import TransferAgent, TransferConfig

log = logging.getLogger(__name__)


def engine_config(config: ClusterConfig, role: str) -> EngineConfig:
    return EngineConfig(
        model=config.model,
        dtype=(config.prefill_dtype or config.dtype) if role == "prefill" else config.dtype,
        kv_dtype=resolve_kv_dtype(config.dtype, config.kv_dtype),  # one KV dtype for all
        device=config.device,
        block_size=config.block_size,
        num_blocks=config.prefill_blocks if role == "prefill" else config.decode_blocks,
        prefill_chunk=config.prefill_chunk, max_batch_size=config.max_batch_size,
        num_threads=config.cpu.threads(role),  # None: as pinned at start (common/cpu.py)
    )


class WorkerRuntime:
    """Engine + mailbox + transfer agent of one worker process."""

    def __init__(self, config: ClusterConfig, role: str, index: int) -> None:
        self.config = config
        self.role = role
        self.instance_id = config.instance_id(role, index)
        self.inbox_address = config.inbox(role, index)
        self.conductor = config.inbox("conductor")
        shm = worker_segment(self.instance_id, config.kv_path, config.device)
        self.engine = Engine(replace(engine_config(config, role), kv_shm_path=shm))
        close_at_exit(self.engine.kv)
        self.mail = Mailbox(self.inbox_address, self.instance_id)
        self.transfer = TransferAgent(TransferConfig(hostname=config.host,
                                                     protocol=config.transfer_protocol))
        kv = self.engine.kv
        self.transfer.register(kv.base_address, kv.nbytes)
        self._event_seq = 0

    def registration(self) -> RegisterWorker:
        kv = self.engine.kv
        return RegisterWorker(
            instance_id=self.instance_id, role=self.role, inbox=self.inbox_address,
            transfer_session=self.transfer.session_id, kv_base=kv.base_address,
            block_nbytes=kv.block_nbytes, layer_nbytes=kv.layer_nbytes,
            num_blocks=kv.num_blocks, block_size=self.engine.config.block_size,
            kv_shm_path=kv.shm_path, host_id=host_id())

    def heartbeat(self, load: WorkerLoad) -> WorkerHeartbeat:
        pool = self.engine.pool
        stored: list[str] = []
        removed: list[str] = []
        for event in pool.drain_events():
            (stored if isinstance(event, BlockStored) else removed).append(event.key.hex())
        self._event_seq += 1
        return WorkerHeartbeat(
            instance_id=self.instance_id, role=self.role, load=load,
            free_blocks=pool.num_free, used_blocks=pool.num_used,
            total_blocks=pool.num_blocks, stored_keys=stored, removed_keys=removed,
            event_seq=self._event_seq)

    async def heartbeat_loop(self, load: Callable[[], WorkerLoad]) -> None:
        """Register, then beat every interval; registering again every few beats lets a
        restarted conductor relearn us without a special handshake."""
        beats = 0
        while True:
            if beats % 20 == 0:
                self.mail.send(self.conductor, self.registration())
            self.mail.send(self.conductor, self.heartbeat(load()))
            beats += 1
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def close(self) -> None:
        self.mail.close()
        self.transfer.close()
        self.engine.kv.close()


def fail_step(rt: WorkerRuntime, planned: list, exc: Exception) -> None:
    """The engine refused a step (a bug, not load): fail the prompts it carried and keep
    serving. ``planned``: (job, tokens) pairs; each job has ``.task`` and ``.aborted``.
    Call from the ``except`` block (the traceback is logged)."""
    log.exception("%s: %s step failed", rt.instance_id, rt.role)
    for job, _ in planned:
        job.aborted = True
        rt.mail.send(rt.conductor, RequestFailed(job.task.request_id, 500, "internal_error",
                                                 f"prefill failed: {exc}"))


def make_generator(params: SamplingParams, stream: int) -> Optional[torch.Generator]:
    """A seeded request's generator for one side of the handover: ``stream`` 0 samples the
    first token (prefill), 1 the rest (decode). Same seed → same tokens, on any workers."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator().manual_seed(int(params.seed) * 2 + stream)
