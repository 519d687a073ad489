"""What the scheduler sees: instance states, request info, decisions, config.

The conductor builds these from KV events, store-master lookups and worker load reports;
the simulator builds them from its own model of the cluster. Neither zmq nor torch here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Iterable, Optional, Sequence

from common.scheduling.queued import QueuedPrompts
from common.scheduling.window import PlacedWindow

if TYPE_CHECKING:
    from common.scheduling.cost import CostModel

BlockKey = Hashable  # bytes (128-bit chained hash) live, int in traces


class PrefixIndex:
    """Set of block keys held by one instance, fed by KV events.

    ``prefix_len(keys)`` = number of leading keys of a request that are present.
    """

    def __init__(self, keys: Iterable[BlockKey] = ()) -> None:
        self._keys: set[BlockKey] = set(keys)

    def on_stored(self, keys: Iterable[BlockKey]) -> None:
        self._keys.update(keys)

    def on_removed(self, keys: Iterable[BlockKey]) -> None:
        self._keys.difference_update(keys)

    def replace(self, keys: Iterable[BlockKey]) -> None:
        """Hold exactly ``keys`` (a resync from a snapshot); views of the set stay valid."""
        self._keys.clear()
        self._keys.update(keys)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def queued_within(self, keys: Sequence[BlockKey]) -> Optional[float]:
        """Where some of ``keys`` count as present only because prompts queued on the
        instance compute them, the seconds until the last of those is predicted done
        (a view that counts those: services/conductor/placement.py); else None."""
        return None

    def prefix_len(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        for k in keys:
            if k not in self:
                break
            n += 1
        return n


class LRUBlockCache(PrefixIndex):
    """A PrefixIndex of bounded capacity (in blocks) with LRU eviction (simulator caches).

    ``prefix_len`` does not touch; ``touch(keys)`` marks keys used and inserts missing
    ones, evicting least-recently-used keys beyond capacity, and returns evicted keys.
    """

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__()
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def on_stored(self, keys: Iterable[BlockKey]) -> None:
        self.touch(keys)

    def on_removed(self, keys: Iterable[BlockKey]) -> None:
        for k in keys:
            self._lru.pop(k, None)

    def touch(self, keys: Iterable[BlockKey]) -> list[BlockKey]:
        lru = self._lru
        for k in keys:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        evicted: list[BlockKey] = []
        while len(lru) > self.capacity_blocks:
            evicted.append(lru.popitem(last=False)[0])
        return evicted

    def check_integrity(self) -> None:
        assert len(self._lru) <= self.capacity_blocks


MAX_SHORTER_LOAD = 0.5  # at most 2x: the window holds the queue, counted already, as much
# as the arrivals to come (0.9 rejected 2 long prompts of 100 at 1 req/s that took 15-19 s)


@dataclass
class PrefillInstanceState:
    """A prefill instance as the conductor sees it.

    ``queue_seconds``: predicted seconds until a new request could start (remaining time
    of the running prefill plus the predicted prefill times of the queued ones).
    ``queued``: where the instance computes the shortest prompts first (``prefill_order``),
    the placed prompts (common/scheduling/queued.py: each one's tokens to compute and
    predicted seconds left, one that has waited ``prefill_max_wait_s`` with 0 tokens): a
    new prompt waits for those no longer than it, and, while a longer one computes, for
    1.5 steps of ``step_tokens`` of it: the rest of the step in flight (half of one, on
    average) and the step the new one joins, which the longer one fills (at 2 req/s
    short prompts waited 0.97 s where one step of the longer was predicted: 0.28); not at
    all if the new one has at most ``preempt_tokens`` (its step runs inside the longer
    one's: services/prefill/preempt.py). None: arrival order (a new prompt waits
    ``queue_seconds``). A prompt whose prefix a queued prompt computes waits for that one
    to be done (services/prefill/queue.py), then as any other, bounded by the whole queue
    (it once waited all of it: a 15-token prompt predicted 10.4 s took 1.6).

    Shortest first, the prompts shorter than a new one that arrive while it waits or
    computes go first too, which the queue cannot show. ``recent``, the (tokens, predicted
    compute seconds) of the prompts placed on the instance in the last ``RECENT_WINDOW_S``
    (common/scheduling/window.py), gives the share of its time those take (``rho``, at
    most ``MAX_SHORTER_LOAD``): a prompt's wait and compute stretch by 1 / (1 - rho), as a
    job's in a shortest-remaining-first queue, though never past ``max_wait_s``, where the
    worker takes it first (at 2 req/s the median error of the predictions was -28 to -39 %
    in nine runs without this; -22 to -33 % in seven with it, -7 to -20 % offline on the
    first nine's logs).
    """

    instance_id: str
    queue_seconds: float
    prefix_index: PrefixIndex
    queued_requests: int = 0
    cost: Optional["CostModel"] = None  # its own prefill cost (a group's); None: the scheduler's
    queued: Optional[QueuedPrompts] = None
    step_tokens: int = 256
    preempt_tokens: int = 0  # a prompt of at most these preempts a longer one's step (0: none)
    recent: PlacedWindow = field(default_factory=PlacedWindow)  # placed lately
    max_wait_s: Optional[float] = None  # a prompt that waited this long goes first

    def wait_s(self, new_tokens: int, behind_s: Optional[float] = None,
               own_s: float = 0.0) -> float:
        """Predicted seconds a prompt of ``new_tokens`` to compute, ``own_s`` of compute,
        waits (besides that compute); ``behind_s``: its prefix is queued prompts', done in
        that many seconds (``PrefixIndex.queued_within``)."""
        if self.queued is None:
            return self.queue_seconds
        wait = self._shortest_first_wait_s(new_tokens, own_s)
        return wait if behind_s is None else min(self.queue_seconds, max(behind_s, wait))

    def _shortest_first_wait_s(self, new_tokens: int, own_s: float) -> float:
        assert self.queued is not None
        ahead = self.queued.ahead_s(new_tokens)
        longer = self.queued.next_longer(new_tokens)  # the next by the worker's order:
        if longer is not None and new_tokens > self.preempt_tokens:  # computing now
            tokens, seconds = longer
            ahead += seconds * min(1.0, 1.5 * self.step_tokens / tokens)
        rho = min(MAX_SHORTER_LOAD,
                  self.recent.seconds_below(new_tokens) / self.recent.window_s)
        stretched = (ahead + own_s) / (1.0 - rho) - own_s
        return stretched if self.max_wait_s is None else min(stretched,
                                                             max(ahead, self.max_wait_s))


@dataclass(frozen=True)
class DecodeSlot:
    """One request's KV footprint on a decode instance (for load prediction).

    ``start_s``: when it joined (running) or is predicted to join (incoming) decode.
    ``decode_s``: its predicted decode duration (e.g. max_tokens x predicted TBT);
    ``None`` = the typical decode time ``SchedulerConfig.expected_decode_s``.
    """

    start_s: float
    tokens: int
    decode_s: Optional[float] = None
    sequences: int = 1  # its n choices decode as n sequences of the batch


@dataclass
class DecodeInstanceState:
    """A decode instance: current batch, and the requests predicted to arrive.

    ``max_batch``: a fixed cap on concurrent sequences (``None``: KV memory only).
    ``step_batch``: the most sequences one decode step runs (the live worker's
    ``max_batch_size``); beyond it sequences take turns and TBT grows (``None``: no limit).
    """

    instance_id: str
    batch_size: int
    total_context_tokens: int
    free_blocks: int
    block_size: int
    running: list[DecodeSlot] = field(default_factory=list)
    incoming: list[DecodeSlot] = field(default_factory=list)
    max_batch: Optional[int] = None
    step_batch: Optional[int] = None

    @property
    def capacity_tokens(self) -> int:
        return self.free_blocks * self.block_size + self.total_context_tokens


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    block_keys: Sequence[BlockKey]
    prompt_tokens: int
    kv_tokens: int  # the most KV it holds on its decode instance, prompt included
    # (whole blocks of every choice: common/kv/demand.py)
    sequences: int = 1  # sequences it decodes as (its n choices), each attending the prompt


NO_INSTANCES = "no_instances"  # a role has no live instance (the conductor may wait for one)
REJECT_REASONS = (NO_INSTANCES, "ttft_slo", "decode_full", "tbt_slo", "queue_full")


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused before any work, and when to try again: the policy's own
    decision, carried whole to the client (the router's 429, ``Retry-After``).

    ``reason``: ``no_instances`` (nothing to place on), ``ttft_slo`` (predicted TTFT over
    the SLO), ``decode_full`` (no decode instance can hold prompt + max_tokens),
    ``tbt_slo`` (predicted TBT over the SLO), ``queue_full`` (the conductor's queue bound).
    ``detail``: the numbers behind it, for a human.
    """

    reason: str
    retry_after_s: float
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in REJECT_REASONS:
            raise ValueError(f"unknown rejection reason {self.reason!r}")
        if not 0 < self.retry_after_s < float("inf"):
            raise ValueError(f"retry_after_s must be positive and finite, "
                             f"got {self.retry_after_s}")


@dataclass(frozen=True)
class ScheduleDecision:
    accepted: bool
    prefill_id: Optional[str]
    decode_id: Optional[str]
    prefix_blocks_local: int
    prefix_blocks_to_fetch: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    rejection: Optional[Rejection] = None  # set exactly when not accepted


ADMISSION_MODES = ("none", "early", "predicted")
DECODE_SURVIVAL_MODELS = ("empirical", "uniform")


@dataclass
class SchedulerConfig:
    """Knobs of every policy.

    ``admission``: "none" checks only the TTFT SLO at arrival (decode load is discovered
    after prefill); "early" also rejects when the current decode load cannot meet the
    TBT SLO or hold the request; "predicted" does so on the decode load predicted for the
    moment the request's prefill ends. A ``None`` SLO disables that check.
    ``expected_decode_s``: the typical decode time before any decode has been observed.
    ``decode_survival``: how "predicted" ages decodes once it has history: "empirical"
    (the survival function of recent decode durations) or "uniform" (the paper's single
    typical time, the mean of recent durations); see ``decode_time.py``.
    ``kv_bytes_per_token``/``transfer_bandwidth_bytes_per_s``: ``None`` = the cost model's.
    """

    kvcache_balancing_threshold: float = 2.0
    ttft_slo_s: Optional[float] = 30.0
    tbt_slo_s: Optional[float] = 0.1
    admission: str = "early"
    block_size: int = 512
    kv_bytes_per_token: Optional[int] = None
    transfer_bandwidth_bytes_per_s: Optional[float] = None
    seed: int = 0
    expected_decode_s: float = 10.0
    decode_survival: str = "empirical"

    def __post_init__(self) -> None:
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}")
        if self.decode_survival not in DECODE_SURVIVAL_MODELS:
            raise ValueError(f"decode_survival must be one of {DECODE_SURVIVAL_MODELS}")
