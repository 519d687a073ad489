"""Messages between the stages of a prefill group (chunked pipeline parallelism).

A group is one prefill instance split by layers over ``prefill_stages`` processes
(services/prefill/group.py). Stage 0, the head, is the only one the conductor knows: it
takes tasks, owns the block pool (a block id names the same block on every stage, each
holding its own layers of it), plans each step and computes its layers. Every later stage
gets the step from the one before it: the parts (which tokens of which prompt, into which
blocks, where their KV goes) in a ``StageStep``, the hidden states in a slot of its
``HiddenRoute`` (shared memory or the transfer engine, services/prefill/hidden.py). Each stage
streams its own layers' KV to the decode worker and the store, and reports to the head.

Liveness: the head beats (``StageBeat``) and every follower says hello (``StageHello``,
which also carries its hidden-state route to its predecessor) each heartbeat interval.
A follower that hears no beat for ``heartbeat_timeout_s`` exits (its writes stop with it;
the supervisor starts it again), so a head that heard nothing from a follower for twice
that knows none of its writes can land any more.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from common.ipc import message
from common.protocol import Fence, StreamTarget
from common.sampling_params import SampledToken, SamplingParams
from common.store.plans import GetPlan, PutPlan
from services.prefill.hidden import HiddenRoute


@dataclass(frozen=True)
class PartOpen:
    """The first chunk of a request on a stage: open its KV stream. The leading
    ``cached_blocks`` blocks are present already (the head's cache) or loaded now from the
    store, layer by layer (``load``, the blocks from ``load_from``): they go to the decode
    worker whole."""

    target: StreamTarget
    cached_blocks: int
    load: Optional[GetPlan] = None
    load_from: int = 0


@dataclass(frozen=True)
class StagePart:
    """One prompt's chunk in a step: tokens [start, end) of ``prompt_len`` into
    ``block_table``. ``put``: the store objects this chunk completes (prompt blocks
    ``put_blocks``), written layer by layer by each stage. ``sampling`` on the last chunk."""

    request_id: str
    fence: Fence
    prompt_len: int
    start: int
    end: int
    block_table: list[int]
    deadline: float
    opening: Optional[PartOpen] = None
    put: Optional[PutPlan] = None
    put_blocks: list[int] = field(default_factory=list)
    sampling: Optional[SamplingParams] = None
    poisoned: bool = False  # an earlier stage computed it from a failed load: garbage
    adapter: Optional[str] = None  # the LoRA adapter it runs on (``sampling.adapter``)


@message
class StageStep:
    """Stage k → k+1: compute ``parts`` for your layers; the hidden states ([tokens,
    hidden], ``dtype``) are in ``slot`` of your route. Answer ``StageAck`` once read."""

    head_epoch: int
    step: int
    slot: int
    tokens: int
    dtype: str
    parts: list[StagePart]


@message
class StageAck:
    """Stage k+1 → k: ``slot`` is free again."""

    head_epoch: int
    step: int
    slot: int


@message
class StageAbort:
    """Head → followers: drop this request; answer with a failed ``StageReport`` once
    none of your writes for it can land."""

    head_epoch: int
    request_id: str
    fence: Fence


@message
class StageStored:
    """A follower → head: which of step ``step``'s store writes (in part order, then
    ``put.keys`` order) this stage finished; the head commits what every stage wrote."""

    head_epoch: int
    stage: int
    step: int
    written: list[bool]


@message
class StageReport:
    """A follower → head: its part of the request is over and none of its writes for it
    can land any more. ``ok``: every layer's KV landed on the decode worker. The last
    stage adds the first tokens. ``compute_s``/``wait_s``: this stage's share of the steps
    and its time blocked on transfers (loads, a full hidden-state ring)."""

    head_epoch: int
    stage: int
    request_id: str
    fence: Fence
    ok: bool
    error: str = ""
    kv_bytes: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    first: list[SampledToken] = field(default_factory=list)  # the last stage's, per choice
    invalid: bool = False  # not ok by the request's fault (a grammar it cannot compile)


@message
class StageHello:
    """A follower → head and → its predecessor, every heartbeat interval: who it is
    (``epoch``: this incarnation), where its hidden-state slots are, and the bytes it
    moved so far (followers send no heartbeats of their own: the head's carry them)."""

    stage: int
    epoch: int
    inbox: str
    route: HiddenRoute
    head_epoch: int = 0  # the head it follows (0: none yet)
    kv_bytes: dict[str, int] = field(default_factory=dict)  # as WorkerHeartbeat's


@message
class StageBeat:
    """Head → followers, every heartbeat interval: alive, and which incarnation."""

    head_epoch: int
