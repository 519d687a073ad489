"""What prefill and decode workers share: the engine, the transfer agent over the paged
KV memory, registration with the conductor, and heartbeats carrying load and KV events."""
from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from dataclasses import replace
from typing import Any, Callable, Optional

import torch

from common import worker_metrics
from common.config import ClusterConfig
from common.drain import current as current_drain
from common.engine import Engine, EngineConfig, UnknownModelError
from common.engine.profiling import StepProfiler
from common.host import host_id
from common.kv.cuda_ipc import export as export_ipc
from common.kv.events import KVEvents
from common.kv.shm_kv import close_at_exit, worker_segment
from common.model.loader import quantized_params
from common.mailbox import Mailbox
from common.service import StartupError
from common.protocol import (KVResync, KVSnapshot, MachineCost, ReRegister, RegisterWorker,
                             RequestFailed, StepTotals, WorkerHeartbeat, WorkerLeaving,
                             WorkerLoad)
from common.transfer import TransferAgent, TransferConfig

log = logging.getLogger(__name__)


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX). Without it
    (AVX2 only) torch converts every bfloat16 matmul to float32 and back: ~7x slower."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# The share of a host's memory its workers' bfloat16 expansions of a quantized model may
# take together (``bfloat16_fits``); a store's segments and the KV memory want the rest
EXPANSION_SHARE = 0.5


def prefill_dtype(config: ClusterConfig, index: int = 0) -> str:
    """Prefill worker ``index``'s compute dtype, resolved on its own host: ``prefill_dtype``,
    ``dtype`` when unset, and for ``auto`` bfloat16 on a CPU that computes it natively
    (~1.35x faster prefill, BENCHMARKS.md) where the model's quantized matrices expanded
    to it fit (``bfloat16_fits``), and ``dtype`` everywhere else; for ``int8`` float32 (its
    linears in int8: ``linear_dtype``)."""
    if config.prefill_dtype == "int8":
        return "float32"
    if config.prefill_dtype != "auto":
        return config.prefill_dtype or config.dtype
    if config.device == "cpu" and native_bfloat16() and bfloat16_fits(config, "prefill", index):
        return "bfloat16"
    return config.dtype


def linear_dtype(config: ClusterConfig, role: str, index: int = 0) -> Optional[str]:
    """A decode or colocated worker's ``linear_dtype``, resolved on its own host: for
    ``auto`` bfloat16 on a CPU that computes it natively when the worker computes in
    float32 and the model's quantized matrices expanded to it fit (``bfloat16_fits``),
    else None (its dtype). A prefill worker's linears take its compute dtype, or int8 with
    ``prefill_dtype = "int8"``."""
    if role == "prefill":
        return "int8" if config.prefill_dtype == "int8" else None
    if role not in ("decode", "colocated") or config.linear_dtype is None:
        return None
    if config.linear_dtype != "auto":
        return config.linear_dtype
    native = config.device == "cpu" and config.dtype == "float32" and native_bfloat16()
    return "bfloat16" if native and bfloat16_fits(config, role, index) else None


def bfloat16_fits(config: ClusterConfig, role: str, index: int) -> bool:
    """Whether the workers on this worker's host may expand the model's quantized matrices
    to bfloat16 (``auto`` dtypes): their expansions together within ``EXPANSION_SHARE`` of
    the host's memory. Else their linears keep the codes (float32 inputs, csrc/linear_q.c:
    the float32 answers, 0.56-1.06 bytes a weight where bfloat16 takes 2): an 8B Q4_K_M
    GGUF expands to ~16 GB in each of a host's prefill and decode workers. A pipeline
    stage holds its share of the layers; a float model has nothing to expand."""
    params = quantized_params(config.model, config.quantization)
    if not params:
        return True
    here = config.address(role, index)
    roles = ("colocated",) if config.mode == "colocated" else ("prefill", "decode")
    share = sum((1 / config.prefill_stages if r == "prefill" else 1)
                for r in roles for i in range(config.processes(r))
                if config.address(r, i) == here)
    need, memory = 2 * params * share, memory_bytes()
    fits = need <= EXPANSION_SHARE * memory
    if not fits:
        _log_once(f"{config.model}: its quantized matrices expanded to bfloat16 in this "
                  f"host's workers would take {need / 2**30:.1f} GiB, more than "
                  f"{EXPANSION_SHARE:.0%} of its {memory / 2**30:.1f} GiB: they keep their "
                  "codes (float32 inputs) where the dtypes are auto; set prefill_dtype and "
                  "linear_dtype to bfloat16 to expand them anyway")
    return fits


@functools.cache
def _log_once(message: str) -> None:
    log.warning(message)


def memory_bytes() -> int:
    """This host's memory, or the container's limit where it is lower (cgroup v2 or v1)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def engine_config(config: ClusterConfig, role: str, index: int = 0) -> EngineConfig:
    stage = (0, 1)
    if role == "prefill":  # a group's stage holds its layers only
        place = config.prefill_place(index)
        stage = (place.stage, place.stages)
    return EngineConfig(
        stage=stage,
        model=config.model,
        dtype=prefill_dtype(config, index) if role == "prefill" else config.dtype,
        linear_dtype=linear_dtype(config, role, index),
        quantization=config.quantization,
        chunk_align=config.chunk_align(),
        kv_dtype=config.kv_storage_dtype,  # one KV dtype for all
        device=config.device,
        block_size=config.block_size,
        num_blocks=config.prefill_blocks if role == "prefill" else config.decode_blocks,
        max_batch_size=config.max_batch_size,
        num_threads=config.cpu.threads(role),  # None: as pinned at start (common/cpu.py)
        cuda_graphs=role == "decode",  # only its steps are pure decodes (on a GPU)
        prompt_graph_tokens=config.prefill_graph_tokens if role != "decode" else 0,
        lora_modules=tuple(sorted(config.lora_modules.items())),
    )


class WorkerRuntime:
    """Engine + mailbox + transfer agent of one worker process."""

    def __init__(self, config: ClusterConfig, role: str, index: int) -> None:
        self.config = config
        self.role = role
        self.instance_id = config.instance_id(role, index)
        self.stages = config.prefill_place(index).stages if role == "prefill" else 1
        self.inbox_address = config.inbox(role, index)
        self.conductor = config.inbox("conductor")
        self.dropped: Counter[str] = Counter()  # the worker's drops, reported in heartbeats
        shm = worker_segment(self.instance_id, config.kv_path, config.device)
        try:
            self.engine = Engine(replace(engine_config(config, role, index), kv_shm_path=shm))
        except UnknownModelError as exc:  # a model this engine cannot serve: refuse to start
            raise StartupError(f"model {config.model}: {exc}") from None
        if role == "prefill" and config.prefill_dtype == "auto":
            log.info("prefill_dtype auto: computing in %s (native bfloat16 on this CPU: %s)",
                     self.engine.config.dtype, native_bfloat16())
        if config.linear_dtype == "auto":
            log.info("linear_dtype auto: linears in %s (native bfloat16 on this CPU: %s)",
                     self.engine.config.linear_dtype or self.engine.config.dtype,
                     native_bfloat16())
        close_at_exit(self.engine.kv)
        self.engine.profiler = StepProfiler.from_env(self.instance_id)  # CRESCENT_PROFILE_DIR
        self.metrics = worker_metrics.current()  # GET /metrics, with metrics_port set
        self.metrics_server = worker_metrics.serve(config, role, index)
        self.mail = Mailbox(config.inbox(role, index, bind=True), self.instance_id)
        self.transfer = TransferAgent(TransferConfig(hostname=config.address(role, index),
                                                     protocol=config.transfer_protocol))
        kv = self.engine.kv
        self.transfer.register(kv.base_address, kv.nbytes)
        # GPU KV a same-host prefill worker writes through CUDA IPC (exported once)
        self.kv_ipc = (export_ipc(kv) if role == "decode" and config.kv_path != "transfer_engine"
                       else None)
        self.epoch = time.time_ns()  # this incarnation: fences its messages (protocol.Fence)
        self.left = False  # a drain ended (``leave``): no more beats or registrations
        # False: no new work now (a prefill group missing a stage); beats say draining
        self.available: Callable[[], bool] = lambda: True
        self.kv_bytes: Callable[[], dict[str, int]] = dict  # KV bytes moved, by flow/path
        self.decode_steps: Callable[[], StepTotals] = StepTotals  # a decode worker's steps
        self.cost = self._machine_cost()  # before registering: the conductor prices with it
        self.engine.on_step = self.metrics.step  # served steps only, not the calibration's

    def _machine_cost(self) -> Optional[MachineCost]:
        """With ``cost_profile = "auto"``, this worker's phases fitted on this machine
        (measured at the first start here, then cached: common/engine/calibrate.py). A
        pipeline stage holds a share of the layers: its group is fitted online instead."""
        if self.config.cost_profile != "auto" or self.stages > 1:
            return None
        from common.engine.calibrate import PHASES, machine_cost
        return machine_cost(self.engine, PHASES[self.role],
                            self.config.step_budget(self.role))

    def registration(self) -> RegisterWorker:
        kv = self.engine.kv
        return RegisterWorker(
            instance_id=self.instance_id, role=self.role, inbox=self.inbox_address,
            transfer_session=self.transfer.session_id, kv_base=kv.base_address,
            # a block of the whole model (a pipeline head holds only its layers of it)
            block_nbytes=kv.layer_nbytes * self.engine.model_config.num_layers,
            layer_nbytes=kv.layer_nbytes,
            num_blocks=kv.num_blocks, block_size=self.engine.config.block_size,
            kv_shm_path=kv.shm_path, host_id=host_id(), epoch=self.epoch, stages=self.stages,
            kv_ipc=self.kv_ipc, cost=self.cost)

    def heartbeat(self, load: WorkerLoad) -> WorkerHeartbeat:
        """Load and the pool's KV events since the last beat, in order, numbered."""
        pool = self.engine.pool
        events = KVEvents.of(pool.drain_events())
        return WorkerHeartbeat(
            instance_id=self.instance_id, role=self.role, load=load,
            free_blocks=pool.num_free, used_blocks=pool.num_used,
            total_blocks=pool.num_blocks, events=events, event_seq=pool.last_seq,
            epoch=self.epoch, inbox=self.inbox_address,
            draining=current_drain().active or not self.available(),
            dropped=drop_counts(self.dropped, self.mail), kv_bytes=self.kv_bytes(),
            decode_steps=self.decode_steps())

    @property
    def handlers(self) -> dict[type, Callable[[Any], None]]:
        """What every worker's inbox handles the same way (merged into its table)."""
        return {ReRegister: self.on_reregister, KVResync: self.on_kv_resync}

    def leave(self) -> None:
        """The end of a drain: the conductor removes us now; no beat follows."""
        self.left = True
        self.mail.send(self.conductor, WorkerLeaving(self.instance_id, self.epoch))

    def on_reregister(self, msg: ReRegister) -> None:
        """The conductor does not know us (it restarted): register now."""
        if msg.instance_id == self.instance_id and not self.left:
            log.info("%s: the conductor asked; registering again", self.instance_id)
            self.mail.send(self.conductor, self.registration())

    def on_kv_resync(self, msg: KVResync) -> None:
        """The conductor missed some of our KV events: send every cached key."""
        if msg.instance_id == self.instance_id:
            pool = self.engine.pool
            self.mail.send(self.conductor, KVSnapshot(
                self.instance_id, self.epoch, pool.last_seq,
                [k.hex() for k in pool.cached_keys()]))

    async def heartbeat_loop(self, load: Callable[[], WorkerLoad],
                             idle: Optional[Callable[[], bool]] = None) -> None:
        """Register, then beat every interval. A conductor that gets a beat it does not
        know answers ReRegister; registering every few beats anyway covers a lost one.
        With ``idle``, SIGTERM drains (common/drain.py): the next beat comes at once and
        says ``draining``, and the process stops once ``idle()``."""
        drain = current_drain()
        if idle is not None:
            drain.until(idle, self.leave)
        beats = 0
        while not self.left:
            if beats % 20 == 0:
                self.mail.send(self.conductor, self.registration())
            beat = self.heartbeat(load())
            self.metrics.load(beat.load.running, beat.load.queued)
            self.mail.send(self.conductor, beat)
            beats += 1
            await drain.sleep(self.config.heartbeat_interval_s)

    def close(self) -> None:
        worker_metrics.stop(self.metrics_server)
        self.mail.close()
        self.transfer.close()
        self.engine.kv.close()


def drop_counts(dropped: Counter[str], mail: Mailbox) -> dict[str, int]:
    """What a worker dropped, by reason, with its full outboxes as ``outbox_full``."""
    counts = dict(dropped)
    outbox = sum(mail.dropped.values())
    if outbox:
        counts["outbox_full"] = outbox
    return counts


def fail_step(rt: WorkerRuntime, planned: list, exc: Exception) -> None:
    """The engine refused a step (a bug, not load): fail the prompts it carried and keep
    serving. ``planned``: (job, tokens) pairs; each job has ``.task`` and ``.aborted``.
    Call from the ``except`` block (the traceback is logged)."""
    log.exception("%s: %s step failed", rt.instance_id, rt.role)
    for job, _ in planned:
        job.aborted = True
        rt.mail.send(rt.conductor, RequestFailed(job.task.request_id, 500, "internal_error",
                                                 f"prefill failed: {exc}",
                                                 fence=job.task.fence))
