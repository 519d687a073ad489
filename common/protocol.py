"""Every control message between Crescent's serving processes, grouped by receiver.

Topology (see common/config.py): each process binds one PULL inbox and PUSHes to the
inboxes of the others. Block keys travel hex-encoded; token ids as lists of ints.
Nested values are frozen dataclasses the codec decodes and validates too:
``SamplingParams`` (common/sampling_params.py), ``Rejection`` (the scheduling policy's),
``WorkerLoad`` (below), ``KVEvents`` (common/kv/events.py).
KV bytes never travel here: only addresses, block ids and transfer-engine session ids.
Store messages live in common/store/protocol.py, the routers' among themselves in
services/router/peer_logs.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from common.ipc import message
from common.kv.events import KVEvents
from common.sampling_params import PromptLogprobs, SampledToken, SamplingParams, TopLogprobs
from common.scheduling.cost import DecodeCoefficients, PrefillCoefficients
from common.scheduling.state import Rejection

# ---------------------------------------------------------------- fencing


@dataclass(frozen=True)
class Fence:
    """Which reservation a piece of KV work belongs to: the decode worker's incarnation
    (``epoch``, chosen at its start) and the reservation's ``generation`` (minted by that
    incarnation from 1 up, never reused). The decode worker admits KV only under the
    fence of a live reservation; the default fence matches none (fail closed)."""

    epoch: int = 0
    generation: int = 0


# ---------------------------------------------------------------- to the conductor


@dataclass(frozen=True)
class MachineCost:
    """A worker's own phases timed and fitted on its machine (common/engine/calibrate.py):
    the conductor prices its work with them (``cost_profile = "auto"``)."""

    key: str  # what was measured: machine, model, dtypes, threads (JSON)
    prefill: Optional[PrefillCoefficients] = None
    decode: Optional[DecodeCoefficients] = None


@message
class RegisterWorker:
    instance_id: str
    role: str  # "prefill" | "decode"
    inbox: str  # the worker's PULL address
    transfer_session: str  # mooncake session id ("host:port")
    kv_base: int  # address of block 0 in the worker's paged KV memory
    block_nbytes: int  # block and layer sizes: a prefill → decode pair must agree on them
    layer_nbytes: int
    num_blocks: int
    block_size: int
    kv_shm_path: Optional[str] = None  # the KV memory as a /dev/shm file same-host peers map
    host_id: Optional[str] = None  # boot id + netns (common/host.py): who can map kv_shm_path
    epoch: int = 0  # this incarnation (start time, ns): a higher one replaces it
    kv_ipc: Optional[str] = None  # GPU KV memory: its CUDA IPC handle (common/kv/cuda_ipc.py)
    stages: int = 1  # a prefill pipeline group's processes (its head registers the group)
    cost: Optional[MachineCost] = None  # fitted on its machine ("auto" cost profile)


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker is busy with, as its heartbeat reports it (zero where a role has none)."""

    queued: int = 0  # requests waiting (prefill: queued tasks; decode: awaiting KV)
    queued_tokens: int = 0  # prefill: uncached prompt tokens still to compute
    running: int = 0  # decode: batch size
    context_tokens: int = 0  # decode: sum of contexts in the batch
    quarantined: int = 0  # decode: reservations held until their writer's word


@dataclass(frozen=True)
class StepTotals:
    """A decode worker's steps so far, this incarnation (cumulative: a lost beat loses
    none): the conductor scales its decode profile by what they really took."""

    steps: int = 0
    sequences: int = 0  # summed over the steps
    context_tokens: int = 0  # summed over the steps
    seconds: float = 0.0  # each a token's interval: compute, sampling, streaming, inbox

    def add(self, sequences: int, context_tokens: int, seconds: float) -> "StepTotals":
        return StepTotals(self.steps + 1, self.sequences + sequences,
                          self.context_tokens + context_tokens, self.seconds + seconds)


@message
class WorkerHeartbeat:
    instance_id: str
    role: str
    load: WorkerLoad
    free_blocks: int  # allocatable now (truly free + cached-but-unreferenced)
    used_blocks: int  # referenced by a live request
    total_blocks: int
    events: KVEvents  # the pool's KV events since the last beat, in sequence order
    event_seq: int  # the pool's latest event: a gap shows even in a beat without events
    epoch: int = 0  # the sender's incarnation: a beat of a replaced one is dropped
    inbox: Optional[str] = None  # the sender's: where a ReRegister goes
    draining: bool = False  # SIGTERM: finishing in-flight work; place nothing new here
    # What this incarnation dropped or gave up on, by reason, cumulative: stale messages (e.g.
    # "KVReady", "duplicate"), "outbox_full", "quarantine_expired", "store_load" (recomputed).
    dropped: dict[str, int] = field(default_factory=dict)
    # Bytes this incarnation moved, cumulative, by "FLOW/PATH": FLOW decode, hidden (to the
    # next stage), store_read or store_write; PATH shm, cuda_ipc, pinned or transfer_engine.
    kv_bytes: dict[str, int] = field(default_factory=dict)
    decode_steps: StepTotals = field(default_factory=StepTotals)  # a decode worker's


@message
class SubmitRequest:
    """Router → conductor: a validated, tokenized request."""

    request_id: str
    token_ids: list[int]
    block_keys: list[str]
    sampling: SamplingParams  # max_tokens resolved by the router
    arrival_time: float
    # the inbox of the router that took it, where its answers and tokens go ("": the
    # first router's; the conductor answers only the cluster's routers)
    router_inbox: str = ""


@message
class AbortRequest:
    """Router → conductor (client gone), conductor → workers (free everything)."""

    request_id: str
    reason: str = "aborted"
    fence: Optional[Fence] = None  # set: only that reservation (a late one given back)


@message
class BlocksReserved:
    """Decode → conductor: blocks reserved for a request's prompt and output."""

    request_id: str
    instance_id: str
    block_ids: list[int]
    fence: Fence = Fence()  # the reservation's: PrefillTask, KVReady/KVFailed carry it
    attempt: int = 0  # echoed from ReserveBlocks: an older attempt's is given back


@message
class ReserveFailed:
    request_id: str
    instance_id: str
    reason: str
    attempt: int = 0


@message
class PrefillDone:
    """Prefill → conductor: the KV of the prompt is on the decode worker."""

    request_id: str
    instance_id: str
    prompt_tokens: int
    cached_tokens: int  # tokens reused (local or global pool)
    global_hit_tokens: int  # of those, loaded from the store
    prefill_seconds: float
    transfer_bytes: int
    transfer_seconds: float = 0.0  # time the KV stream was in flight (overlaps compute)
    fence: Fence = Fence()  # the reservation it filled: a stale one is dropped
    wait_s: float = 0.0  # time blocked on transfers (loads, the pipeline, the last writes)
    # its prefix read from the store: bytes, and seconds from the first read's start to the
    # last one's end (the conductor learns the store's read bandwidth from them)
    store_read_bytes: int = 0
    store_read_s: float = 0.0
    admit_s: float = 0.0  # the worker's admission: store lookups, blocks, whole-block reads


@message
class WorkerLeaving:
    """Worker → conductor, last of a graceful stop (SIGTERM, common/drain.py): remove it
    now, and fail or re-run what it still holds (a drain that ran out of time), rather
    than after the heartbeat timeout."""

    instance_id: str
    epoch: int = 0  # the leaving incarnation: a newer one is kept


KV_FAILED = "kv_failed"  # RequestFinished.finish_reason: the prefill failed its KV


@message
class RequestFinished:
    """Decode → conductor: the request left the system (any reason); blocks are free.
    ``KV_FAILED``: its prefill failed it (KVFailed), whose RequestFailed follows."""

    request_id: str
    instance_id: str
    finish_reason: str
    fence: Fence = Fence()  # the reservation freed: an old one's ends no re-run request


@message
class RequestFailed:
    """Any worker → conductor, conductor → router: the request cannot complete."""

    request_id: str
    status: int
    error_type: str
    message: str
    retry_after_s: Optional[float] = None
    fence: Optional[Fence] = None  # set by a worker: the reservation the failure is about
    # Set by the conductor when only the worker was lost (a decode worker mid-stream):
    # the router may go on with a continuation (services/router/resume.py)
    resumable: bool = False


@message
class KVSnapshot:
    """Worker → conductor, asked by ``KVResync``: every block key cached now, as of KV
    event ``event_seq`` of incarnation ``epoch`` (later events follow in heartbeats)."""

    instance_id: str
    epoch: int
    event_seq: int
    keys: list[str]


# ---------------------------------------------------------------- to any worker


@message
class KVResync:
    """Conductor → worker: its KV events had a gap (a lost heartbeat); send a KVSnapshot."""

    instance_id: str


@message
class ReRegister:
    """Conductor → a worker whose heartbeat it does not know (the conductor restarted, or
    it had given the worker up): send ``RegisterWorker`` now rather than at the next
    periodic registration, so the worker is used again at once."""

    instance_id: str


# ---------------------------------------------------------------- to a prefill worker


@dataclass(frozen=True)
class StreamTarget:
    """Where a request's KV goes: its decode worker's reserved blocks, by the transfer
    engine (``session`` at ``kv_base``) or, on the same host, its shared-memory file."""

    decode_id: str
    session: str
    kv_base: int
    block_ids: list[int]
    shm_path: Optional[str] = None
    host_id: Optional[str] = None
    ipc: Optional[str] = None  # its GPU KV memory's CUDA IPC handle


@message
class PrefillTask:
    request_id: str
    token_ids: list[int]
    block_keys: list[str]  # hex key of each full block: the router's, never hashed again
    sampling: SamplingParams  # the first token is sampled on the prefill side
    decode_id: str
    decode_inbox: str
    decode_session: str
    decode_kv_base: int
    decode_block_ids: list[int]
    deadline: float  # wall-clock time after which the work is abandoned
    decode_shm_path: Optional[str] = None  # set: same-host prefill may write KV there
    decode_host_id: Optional[str] = None
    fence: Fence = Fence()  # the reservation written into; every answer carries it
    prefill_epoch: int = 0  # the incarnation it is for: another one drops it
    store_loads: bool = True  # False: compute past the local prefix (a failed load's re-run)
    decode_kv_ipc: Optional[str] = None  # set: a same-host prefill on the GPU may write there

    def keys(self, block_size: int) -> list[bytes]:
        """The block keys, checked against the prompt: one per full block."""
        if len(self.block_keys) != len(self.token_ids) // block_size:
            raise ValueError(f"{len(self.block_keys)} block keys for a prompt of "
                             f"{len(self.token_ids)} tokens in blocks of {block_size}")
        return [bytes.fromhex(k) for k in self.block_keys]

    @property
    def target(self) -> StreamTarget:
        return StreamTarget(self.decode_id, self.decode_session, self.decode_kv_base,
                            self.decode_block_ids, self.decode_shm_path, self.decode_host_id,
                            self.decode_kv_ipc)


@message
class PrefetchLoads:
    """Conductor → prefill worker with the reservation: ask the store for this prompt now."""
    request_id: str
    block_keys: list[str]  # as PrefillTask's


# ---------------------------------------------------------------- to a decode worker


@message
class ReserveBlocks:
    """Conductor → decode: reserve blocks for prompt + ``sampling.max_tokens``."""

    request_id: str
    prompt_tokens: int
    sampling: SamplingParams
    router_inbox: str
    deadline: float  # if KV has not landed by then, fail (blocks freed once writes stop)
    epoch: int = 0  # the decode incarnation it is for: another one drops it
    writer: Optional[str] = None  # the prefill instance that will write the KV
    writer_epoch: int = 0  # and its incarnation (WorkerGone names dead ones)
    attempt: int = 0  # 1 for a request re-run after its prefill worker was lost
    writer_inbox: Optional[str] = None  # where to ask it about the fence (FenceQuery)


@message
class KVReady:
    """Prefill → decode: every layer of every prompt block has landed; the first token of
    each choice sampled."""

    request_id: str
    first: list[SampledToken]  # one per choice (``sampling.n``), choice 0 first
    prompt_tokens: int
    cached_tokens: int
    fence: Fence = Fence()
    prompt_logprobs: Optional[PromptLogprobs] = None  # where ``sampling.prompt_logprobs``


@message
class KVFailed:
    """Prefill → decode: no write of this fence's stream can land any more (all settled)."""

    request_id: str
    reason: str
    fence: Fence = Fence()


@message
class FenceQuery:
    """Decode → prefill: may a write under ``fence`` still land? Asked, every second, for
    a quarantined reservation. A task computing under it answers when its writes settle
    (KVReady/KVFailed); otherwise no write can come any more (the task never arrived, was
    dropped, or was answered long ago): the prefill worker says so with KVFailed and
    refuses any later task under that fence."""

    request_id: str
    fence: Fence
    decode_inbox: str


@message
class WorkerGone:
    """Conductor → decode: every incarnation of ``instance_id`` but ``live_epoch`` has
    exited (its inbox was bound again), so none of its KV writes can land any more."""

    instance_id: str
    live_epoch: int


# ---------------------------------------------------------------- to the router


@message
class RequestRejected:
    """Conductor → router: refused before any work; the policy's reason and retry time."""

    request_id: str
    rejection: Rejection


@message
class RequestAccepted:
    request_id: str
    prefill_id: str
    decode_id: str
    predicted_ttft_s: float


@message
class TokenDelta:
    """Decode → router: new tokens (and their text) of one choice of a request, in order;
    each choice ends with its own finish reason."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: Optional[list[float]]
    finish_reason: Optional[str]  # "stop" | "length" | None while running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    top_logprobs: list[TopLogprobs] = field(default_factory=list)  # per token, where asked
    index: int = 0  # the choice (of ``sampling.n``) these tokens extend
    # the prompt's own logprobs (``sampling.prompt_logprobs``): in choice 0's first delta
    prompt_logprobs: Optional[PromptLogprobs] = None


@message
class TokenDeltas:
    """Decode → router: the deltas of one decode step (or of one message the worker
    handled) for that router, in order (services/decode/outbox.py)."""

    deltas: list[TokenDelta]
