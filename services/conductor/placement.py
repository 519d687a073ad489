"""Adapter between the conductor's live registry and the pure scheduling policy.

Builds the policy's instance states from heartbeats, KV events and the conductor's own
request tracker, calls ``Scheduler.schedule`` and turns its decision into a Placement, or
passes its ``Rejection`` (reason and retry time) on whole.
"""
from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

from common.config import ClusterConfig
from common.kv.demand import kv_demand
from common.protocol import MachineCost, PrefillDone, SubmitRequest
from common.scheduling import (
    CostModel, DecodeInstanceState, DecodeSlot, PipelineCost, PrefillInstanceState, PrefixIndex,
    Rejection, RequestInfo, SchedulerConfig, make_scheduler,
)
from common.scheduling.prefill_order import PromptOrder
from common.scheduling.window import PlacedWindow
from services.conductor.prefill_queue import PrefillQueue
from services.conductor.calibration import DecodeCalibrator, PrefillCalibrator, ReadBandwidth
from services.conductor.registry import Registry, WorkerState
from services.conductor.tracker import Phase, Tracked, Tracker


@dataclass(frozen=True)
class Placement:
    prefill_id: str
    decode_id: str
    predicted_ttft_s: float
    prefill_tokens: int  # tokens the prefill worker is predicted to compute
    kv_tokens: int  # the KV it may hold on its decode worker (``kv_tokens``)
    store_blocks: int = 0  # leading blocks the store holds past the prefill worker's own


PROFILE_DIR = Path(__file__).resolve().parents[2] / "launch" / "profiles"
# ``cost_profile = "auto"`` prices with this shipped profile until the workers report the
# coefficients they fitted on their machines (RegisterWorker.cost)
AUTO_START = "cpu-smollm2-135m"


def load_cost_model(name: str) -> CostModel:
    """A named profile (common/scheduling), a JSON path, or launch/profiles/<name>.json;
    "auto": the profile the cluster starts from (``AUTO_START``)."""
    name = AUTO_START if name == "auto" else name
    shipped = PROFILE_DIR / f"{name}.json"
    if name not in CostModel.profile_names() and shipped.is_file():
        return CostModel.from_json(shipped)
    return CostModel.profile(name)


class _KeySetIndex(PrefixIndex):
    """A PrefixIndex view over a worker's live key set (no copy per decision), and the
    keys of the prompts queued on it: a prompt whose prefix one of them computes waits
    for it (services/prefill/queue.py) and reuses the prefix, so those keys are as good
    as cached for its prediction. Without them a burst of one conversation's turns was
    priced as if each recomputed the shared prefix: the queue predicted 2-6x too long.
    ``queued``: each such key of the request being placed (the only keys it is asked
    about), the seconds until the prompt computing it is done."""

    def __init__(self, keys: set[str], queued: Optional[dict[str, float]] = None) -> None:
        self._keys = keys
        self.queued = queued or {}

    def __contains__(self, key: str) -> bool:
        return key in self._keys or key in self.queued

    def queued_within(self, keys: Sequence[str]) -> Optional[float]:
        waits = [self.queued[k] for k in keys if k in self.queued and k not in self._keys]
        return max(waits) if waits else None


class Placer:
    def __init__(self, config: ClusterConfig, global_index: Optional[PrefixIndex] = None):
        self.config = config
        self.order = PromptOrder.of(config)  # the prefill workers' (its queues' predictions)
        self.cost = load_cost_model(config.cost_profile)
        self.policy = make_scheduler(config.scheduler, SchedulerConfig(
            kvcache_balancing_threshold=config.kvcache_balancing_threshold,
            ttft_slo_s=config.slo.ttft_s, tbt_slo_s=config.slo.tbt_s,
            admission=config.admission, block_size=config.block_size,
            expected_decode_s=config.expected_decode_s,
            transfer_bandwidth_bytes_per_s=config.transfer_bandwidth_bytes_per_s,
        ), self.cost)
        self.global_index = global_index or PrefixIndex()
        # a cost model and its online calibration per prefill shape (stages per instance):
        # a pipeline group's TTFT is not a single worker's (short prompts gain nothing)
        self.shapes: dict[int, PrefillCalibrator] = {1: PrefillCalibrator(
            self.cost, short_tokens=config.prefill_preempt_tokens)}
        self.store_reads = ReadBandwidth()
        self.decode_steps = DecodeCalibrator(self.cost)
        self.machine_keys: list[str] = []  # the workers' fitted coefficients adopted
        # per prefill worker, the prompts placed on it lately (tokens, predicted compute s)
        self.placed: defaultdict[str, PlacedWindow] = defaultdict(PlacedWindow)
        # per prefill worker, its queue as priced: (what it was priced at, the queue)
        self.queues: dict[str, tuple[tuple, PrefillQueue]] = {}

    def adopt(self, cost: MachineCost) -> bool:
        """With ``cost_profile = "auto"``: price with what a worker fitted on its machine
        (common/engine/calibrate.py) from now on, the first report of each key (a
        restart's, the same key, keeps what the online refit learned since). A prefill
        group's shape starts from it when first met. True if adopted."""
        if self.config.cost_profile != "auto" or cost.key in self.machine_keys:
            return False
        self.machine_keys.append(cost.key)
        if cost.prefill is not None:
            self.cost.prefill = cost.prefill
        if cost.decode is not None:
            self.cost.decode = cost.decode
        return True

    def describe(self) -> dict:
        """The cost model in use, for ``/debug/ttft``."""
        return {"profile": self.config.cost_profile, "machine_keys": self.machine_keys,
                "prefill": asdict(self.cost.prefill), "decode": asdict(self.cost.decode),
                "prefill_overhead_s": self.cost.prefill_overhead_s,
                "prefill_scale": self.cost.prefill_scale,
                "prefill_short_scale": self.cost.prefill_short_scale,
                "prefill_short_tokens": self.cost.prefill_short_tokens,
                "refits": self.calibrator.refits,
                "samples": self.calibrator.samples, **self.decode_steps.describe()}

    @property
    def calibrator(self) -> PrefillCalibrator:
        """The single workers' calibration (the cluster's cost model)."""
        return self.shapes[1]

    def cost_of(self, stages: int) -> CostModel:
        """The prefill cost model of instances of ``stages`` processes."""
        return self._shape(stages).cost

    def _shape(self, stages: int) -> PrefillCalibrator:
        """The calibration of that shape; a group's model starts from the cluster's
        profile (PipelineCost) and is corrected from its own prefills."""
        if stages not in self.shapes:
            pipeline = PipelineCost(self.cost, stages,
                                    self.config.step_budget("prefill"))
            self.shapes[stages] = PrefillCalibrator(pipeline)
        return self.shapes[stages]

    def _prefill_state(self, w: WorkerState, tracker: Optional[Tracker], now: float,
                       req: SubmitRequest) -> PrefillInstanceState:
        """``w`` as the policy sees it for ``req``."""
        cost = self.cost_of(w.info.stages)
        queued = None
        keys: dict[str, float] = {}  # of req's keys, each a queued prompt computes: when done
        preempt = 0 if w.info.stages > 1 else self.config.prefill_preempt_tokens
        if tracker is not None:
            queue = self._queue(w, tracker, cost)
            prompts = queue.at(now, self.order, cost)
            queue_s = prompts.left_s()
            if self.order.shortest:
                queued = prompts
            keys = queue.waits_of(req.block_keys, prompts, now)
            backlog, oldest = self.config.prefill_preempt_backlog_s, queue.oldest_accepted_at()
            if backlog is not None and oldest is not None and now - oldest >= backlog:
                preempt = 0  # the worker's rule (services/prefill/service.py _preemptible)
        else:  # no tracker (tests of the policy alone): the worker's reported queue
            tokens = max(w.beat.load.queued_tokens if w.beat else 0, w.pending_tokens)
            queue_s = cost.prefill_seconds(tokens, 0) if tokens else 0.0
        return PrefillInstanceState(w.instance_id, queue_s, _KeySetIndex(w.cached_keys, keys),
                                    queued_requests=len(w.assigned),
                                    cost=cost if cost is not self.cost else None, queued=queued,
                                    step_tokens=self.config.step_budget("prefill"),
                                    preempt_tokens=preempt,
                                    recent=self._recent(w.instance_id, now),
                                    max_wait_s=self.config.prefill_max_wait_s
                                    if self.order.shortest else None)

    def _queue(self, w: WorkerState, tracker: Tracker, cost: CostModel) -> PrefillQueue:
        """``w``'s queue by its cost model's profile (``cost``), built again only once its
        requests or the profile changed."""
        key = (w.stamp, cost.prefill_key())
        cached = self.queues.get(w.instance_id)
        if cached is None or cached[0] != key:
            cached = self.queues[w.instance_id] = (key, PrefillQueue(
                self.waiting(w, tracker), cost))
        return cached[1]

    def _recent(self, instance_id: str, now: float) -> PlacedWindow:
        """The prompts placed on that prefill worker lately (common/scheduling/window.py:
        what shorter arrivals stretch a prompt's time by), as of ``now``."""
        placed = self.placed[instance_id]
        placed.expire(now)
        return placed

    def queue_seconds(self, w: WorkerState, tracker: Tracker, now: float) -> float:
        """Predicted time until prefill worker ``w`` has computed what it was given: each
        prompt's own prefill time (summed, not the time of one prompt as long as all of
        them: attention is quadratic per prompt, and that overestimated a queue of ten
        prompts about twice), less what the one computing now has predictably done."""
        cost = self.cost_of(w.info.stages)
        return self._queue(w, tracker, cost).at(now, self.order, cost).left_s()

    @staticmethod
    def waiting(w: WorkerState, tracker: Optional[Tracker]) -> list[Tracked]:
        """The requests placed on prefill worker ``w`` whose KV has not landed yet."""
        if tracker is None:
            return []
        return sorted((t for t in w.assigned.values() if t.phase is not Phase.DECODING),
                      key=_accepted_at)

    def _decode_state(self, w: WorkerState, now: float) -> DecodeInstanceState:
        load = w.load
        running, context = load.running, load.context_tokens  # running: sequences
        pending = w.sequences - running
        state = DecodeInstanceState(
            w.instance_id, batch_size=running + max(pending, 0), total_context_tokens=context,
            free_blocks=w.free_blocks, block_size=w.info.block_size,
            step_batch=self.config.max_batch_size)
        if self.policy.config.admission == "predicted":
            state.running, state.incoming = decode_slots(w, now)
        return state

    def place(self, req: SubmitRequest, registry: Registry, now: Optional[float] = None,
              tracker: Optional[Tracker] = None,
              store_loads: bool = True) -> Union[Placement, Rejection]:
        """Place ``req``; ``now`` is wall-clock seconds, ``tracker`` feeds the decode slots.
        ``store_loads`` False: the prefill will read nothing from the store (a re-run after
        a failed load), so only local hits are priced as cached."""
        now = time.time() if now is None else now
        prefill = [self._prefill_state(w, tracker, now, req) for w in registry.by_role("prefill")]
        decode = [self._decode_state(w, now) for w in registry.by_role("decode")]
        need = kv_tokens(req, self.config.block_size)
        info = RequestInfo(req.request_id, req.block_keys, len(req.token_ids), need,
                           req.sampling.n)
        global_len = self.global_index.prefix_len(req.block_keys) if store_loads else 0
        d = self.policy.schedule(info, prefill, decode, global_len, now)
        if d.rejection is not None:
            return d.rejection
        assert d.prefill_id is not None and d.decode_id is not None
        cached = (d.prefix_blocks_local + d.prefix_blocks_to_fetch) * self.config.block_size
        decode_id = d.decode_id
        chosen = registry.get(d.prefill_id)
        if chosen is not None and chosen.info.role == "colocated":
            decode_id = d.prefill_id  # a colocated worker decodes what it prefills
        new = max(len(req.token_ids) - cached, 1)
        if chosen is not None:
            seconds = self.cost_of(chosen.info.stages).prefill_compute_seconds(
                new, len(req.token_ids) - new)
            self.placed[d.prefill_id].add(now, new, seconds)
        return Placement(d.prefill_id, decode_id, d.predicted_ttft_s, new, need,
                         max(0, global_len - d.prefix_blocks_local))

    def observe_store_read(self, msg: PrefillDone) -> Optional[float]:
        """Learn the store's read bandwidth from a prefill's load; the scheduler prices
        fetches with it unless ``transfer_bandwidth_bytes_per_s`` pins the figure. Returns
        the estimate (bytes/s), None until there is one."""
        estimate = self.store_reads.observe(msg.store_read_bytes, msg.store_read_s)
        if estimate is not None and self.config.transfer_bandwidth_bytes_per_s is None:
            self.policy.set_transfer_bandwidth(estimate)
        return estimate

    def observe_prefill(self, msg: PrefillDone, stages: int = 1,
                        alone_ttft_s: Optional[float] = None) -> bool:
        """Feed a prefill's reported time (compute and transfer waits) to the online
        calibration of its instance's shape (``stages`` processes), and its TTFT (accept
        → KV on the decode worker) if it had the instance to itself; True if it refitted."""
        calibrator = self._shape(stages)
        new = msg.prompt_tokens - msg.cached_tokens
        changed = calibrator.observe_compute(new, msg.cached_tokens,
                                             msg.prefill_seconds + msg.wait_s)
        if alone_ttft_s is not None:
            changed = calibrator.observe_alone(new, msg.cached_tokens, alone_ttft_s) or changed
        return changed


def decode_slots(w: WorkerState, now: float) -> tuple[list[DecodeSlot], list[DecodeSlot]]:
    """(running, incoming) slots of the requests assigned to decode worker ``w``.

    Running: decoding since PrefillDone. Incoming: predicted to join at accept + predicted
    TTFT, but not before ``now`` (a late prefill has not started decoding yet).
    """
    running: list[DecodeSlot] = []
    incoming: list[DecodeSlot] = []
    for t in w.assigned.values():
        n = t.req.sampling.n
        if t.phase is Phase.DECODING:
            start = t.decode_started_at if t.decode_started_at is not None else now
            running.append(DecodeSlot(start, t.decode_tokens, sequences=n))
        else:
            incoming.append(DecodeSlot(max(t.accepted_at + t.predicted_ttft_s, now),
                                       t.decode_tokens, sequences=n))
    return running, incoming


def _accepted_at(t: Tracked) -> float:
    return t.accepted_at


def kv_tokens(req: SubmitRequest, block_size: int) -> int:
    """The KV ``req`` may hold on its decode worker, prompt and every choice's output, in
    tokens of whole blocks: what the worker reserves (``common/kv/demand.py``)."""
    return kv_demand(len(req.token_ids), req.sampling.new_tokens, req.sampling.n,
                     block_size).tokens
