"""A prompt on the prefill side: one record, with an explicit state, for the prefill worker
(``Job``), a later stage of its pipeline group (``StageJob``) and the colocated worker
(``services/colocated/service.py`` ``Prefilling``), each adding only what its role keeps.

A prompt is COMPUTING from admission until its last chunk has run; a prefill worker whose
layer-wise store load failed puts it RELOADING (its reads settle) and then COMPUTING again
from its local prefix; ENDING is its last state, while its writes settle and it reports
(handed over, or given up). It leaves its worker's books once it has reported.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Optional

from common.engine.errors import EngineInputError
from common.protocol import PrefillTask
from common.sampling_params import PromptLogprobs, SampledToken
from services.prefill.layer_io import LaunchedLoads, LayerLoads
from services.prefill.prefix import PrefixPlan
from services.prefill.streaming import KVStream

if TYPE_CHECKING:
    from common.engine import Engine


class PrefillFailure(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def checked_keys(task: PrefillTask, engine: "Engine", block_size: int,
                 grouped: bool) -> list[bytes]:
    """The block keys of a task fit for admission; ``PrefillFailure`` where it is not: its
    deadline passed, a prompt the engine refuses, keys that do not fit it (the router's: a
    bug), or prompt logprobs asked of a pipeline group (``grouped``)."""
    if time.time() > task.deadline:
        raise PrefillFailure(504, "timeout", "deadline passed while queued")
    try:
        engine.validate_prompt(task.token_ids)
    except EngineInputError as exc:
        raise PrefillFailure(400, "invalid_request_error", str(exc)) from exc
    try:
        keys = task.keys(block_size)
    except ValueError as exc:
        raise PrefillFailure(500, "internal_error", str(exc)) from exc
    if grouped and task.sampling.prompt_logprobs is not None:
        raise PrefillFailure(400, "invalid_request_error", "prompt logprobs (echo with "
                             "logprobs) are not computed by a pipeline group")
    return keys


class JobState(Enum):
    COMPUTING = "computing"
    RELOADING = "reloading"
    ENDING = "ending"


MOVES = {
    JobState.COMPUTING: {JobState.RELOADING, JobState.ENDING},
    JobState.RELOADING: {JobState.COMPUTING},  # aborted or late meanwhile: ends from there
    JobState.ENDING: set(),
}


@dataclass(eq=False, kw_only=True)
class PromptJob:
    """What every prefill-side role keeps of a prompt it computes."""

    prompt_len: int
    done: int = 0  # tokens whose KV is in its blocks: the cached prefix, then chunks
    state: JobState = JobState.COMPUTING
    stream: Optional[KVStream] = None  # its KV on its way to the decode worker
    loads: Optional[LayerLoads | LaunchedLoads] = None  # its store blocks, loading per layer
    put_futures: list[Future] = field(default_factory=list)  # its layer-wise store writes
    compute_s: float = 0.0  # its share of the steps it was computed in
    wait_s: float = 0.0  # time blocked on transfers: loads, a full pipeline, the stream
    failed: Optional[str] = None  # a load failed: what it computes now is garbage
    aborted: bool = False

    @property
    def remaining(self) -> int:
        return self.prompt_len - self.done

    @property
    def live(self) -> bool:
        """Still computing or about to (not aborted, not ending)."""
        return self.state is not JobState.ENDING and not self.aborted

    def failure(self) -> "PrefillFailure":
        """Why it is given up between steps: aborted, a failed load, or its deadline."""
        if self.aborted:
            return PrefillFailure(499, "aborted", "aborted during prefill")
        if self.failed:
            return PrefillFailure(503, "kv_load_failed", self.failed)
        return PrefillFailure(504, "timeout", "prefill missed its deadline")

    def move(self, to: JobState) -> None:
        if to not in MOVES[self.state]:
            raise RuntimeError(f"a prompt job cannot move from {self.state.value} to "
                               f"{to.value}")
        self.state = to


@dataclass(eq=False, kw_only=True)
class Job(PromptJob):
    """A prefill worker's prompt: its task, blocks and prefix plan."""

    task: PrefillTask
    keys: list[bytes]
    plan: PrefixPlan
    opened: bool = False  # its first chunk was computed (and, in a group, shipped)
    admit_s: float = 0.0  # its admission: store lookups, blocks, a whole-block store read
    arrived: float = 0.0  # time.monotonic() when it was queued (queue.py: its rank)
    preempting: bool = False  # computed whole in a step of its own (preempt.py), not yet run
    # set once its first token is sampled, or it gives up: its last chunk's store write
    # (GPU KV) waits for it (layer_io.PartIO.hold_puts)
    sampled: threading.Event = field(default_factory=threading.Event)
    prompt_parts: list[PromptLogprobs] = field(default_factory=list)  # per chunk, if asked

    @property
    def prompt_logprobs(self) -> Optional[int]:
        return self.task.sampling.prompt_logprobs

    def rewind_to_local_prefix(self, block_size: int) -> None:
        """Its store load failed: compute from its last local hit instead, into the blocks
        the load was to fill (its reads settled); nothing counts as loaded any more."""
        plan = self.plan
        self.plan = replace(plan, cached_blocks=plan.load_from, global_blocks=0, load=None)
        self.loads, self.failed = None, None
        self.done = min(plan.load_from * block_size, self.prompt_len - 1)
        assert self.stream is not None
        self.stream.rewind(plan.load_from)


@dataclass(eq=False, kw_only=True)
class StageJob(PromptJob):
    """A prompt on a later stage of a pipeline group: the head owns its task."""

    zeros: list[int]  # token ids are the head's business: a placeholder of the length
    first: list[SampledToken] = field(default_factory=list)  # sampled here (last stage)
    invalid: bool = False  # ``failed`` by the request's own fault (its grammar): a 400
