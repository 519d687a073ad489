"""A prefill job: an admitted prompt, its blocks, its KV stream, how far it has computed."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from common.protocol import PrefillTask
from common.sampling_params import PromptLogprobs
from services.prefill.layer_io import LayerLoads
from services.prefill.prefix import PrefixPlan
from services.prefill.streaming import KVStream


class PrefillFailure(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


@dataclass
class Job:
    """An admitted prompt: its blocks, its KV stream, and how far it has been computed."""

    task: PrefillTask
    keys: list[bytes]
    plan: PrefixPlan
    stream: KVStream
    done: int  # tokens whose KV is in plan.block_table (cached prefix, then chunks)
    loads: Optional[LayerLoads] = None  # its store blocks, loading layer by layer
    opened: bool = False  # its first chunk was computed (and, in a group, shipped)
    compute_s: float = 0.0  # its share of the steps it was computed in
    wait_s: float = 0.0  # time blocked on transfers: loads, a full pipeline, the stream
    put_futures: list = field(default_factory=list)  # its layer-wise store writes
    failed: Optional[str] = None  # a load failed: what it computes now is garbage
    aborted: bool = False
    prompt_parts: list[PromptLogprobs] = field(default_factory=list)  # per chunk, if asked

    @property
    def prompt_logprobs(self) -> Optional[int]:
        return self.task.sampling.prompt_logprobs

    @property
    def remaining(self) -> int:
        return len(self.task.token_ids) - self.done

    def rewind_to_local_prefix(self, block_size: int) -> None:
        """Its store load failed: compute from its last local hit instead, into the blocks
        the load was to fill (its reads settled); nothing counts as loaded any more."""
        plan = self.plan
        self.plan = replace(plan, cached_blocks=plan.load_from, global_blocks=0, load=None)
        self.loads, self.failed = None, None
        self.done = min(plan.load_from * block_size, len(self.task.token_ids) - 1)
        self.stream.prefix = plan.load_from
