"""A request on the decode worker: reserved blocks, then a running sequence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from common.engine.sampling import SamplingParams
from common.protocol import Fence
from services.decode.detok import IncrementalText

if TYPE_CHECKING:
    from xgrammar import GrammarMatcher


@dataclass
class Reservation:
    """Blocks reserved for a request whose KV is still arriving from a prefill worker."""

    request_id: str
    blocks: list[int]
    prompt_tokens: int
    params: SamplingParams
    router_inbox: str
    deadline: float  # KV must have landed by then
    fence: Fence  # its epoch and generation: only KV under this fence is admitted
    writer: Optional[str] = None  # the prefill instance writing into the blocks
    writer_epoch: int = 0
    writer_inbox: Optional[str] = None  # where its writer is asked about the fence
    release_at: Optional[float] = None  # quarantined: the last-resort free (time.time)
    next_query: float = 0.0  # quarantined: when to ask the writer again (time.time)
    # n > 1: the own blocks of choices 1..n-1, each from the prompt's last partial block
    # on (choice 0 writes into ``blocks``; the prompt's full blocks are shared)
    tails: list[list[int]] = field(default_factory=list)

    @property
    def owned(self) -> list[int]:
        """Every block the reservation holds a reference on."""
        return self.blocks + [b for tail in self.tails for b in tail]


@dataclass
class Running:
    """One choice of a request, decoding: its blocks are the request's shared prompt
    blocks (one reference each) and its own."""

    request_id: str
    blocks: list[int]
    position: int  # position of ``last_token`` (its KV is written by the next step)
    last_token: int
    params: SamplingParams
    router_inbox: str
    prompt_tokens: int
    cached_tokens: int
    text: IncrementalText
    generator: Optional[torch.Generator]
    fence: Fence = Fence()  # the reservation it runs in
    generated: int = 0
    aborted: bool = False
    logprobs: list[float] = field(default_factory=list)
    matcher: Optional[GrammarMatcher] = None  # its response_format's grammar state
    index: int = 0  # the choice, of the request's ``n``

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def context_tokens(self) -> int:
        return self.position + 1
