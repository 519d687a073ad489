"""A stream that outlives its decode worker: the router goes on with a continuation.

The conductor fails a request whose decode worker was lost mid-stream as *resumable*
(``RequestFailed.resumable``). The client has had some tokens of it; the router, which
knows exactly which, submits a continuation: the prompt followed by those tokens, as a new
cluster request (``<id>-resume<k>``) whose ``SamplingParams.resumed`` names them. Any
prefill worker computes it (the prompt's blocks from the KV pool where cached), any decode
worker goes on from it (the continuation counts the resumed tokens as generated: against
``max_tokens``, in the penalties, the grammar and stop strings, and the text held back
for a possible stop string comes out next), and the client's stream carries on with no
error event, no token repeated or missing. A greedy answer is the undisturbed one (up to
the float rounding of a prefill against decode steps); a seeded one goes on with other
draws. With no decode worker left the continuation waits for one (the conductor's
``worker_wait_s``).

Only a request with one choice and no prompt logprobs resumes (``n`` > 1 or ``echo``
with logprobs fail as before), at most ``MAX_RESUMES`` times.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from common.protocol import RequestFailed, SubmitRequest, TokenDelta
from services.router.block_hashing import BlockHasher

MAX_RESUMES = 3


@dataclass
class Resumable:
    """What one request's client has been sent, to go on from after a lost decode
    worker."""

    original: SubmitRequest
    sent_ids: list[int] = field(default_factory=list)  # choice 0's tokens, as streamed
    sent_chars: int = 0  # and the characters of its text
    resumes: int = 0
    finished: bool = False

    def record(self, delta: TokenDelta) -> None:
        self.sent_ids += delta.token_ids
        self.sent_chars += len(delta.text)
        self.finished = self.finished or delta.finish_reason is not None

    def continuation(self, failure: RequestFailed,
                     block_keys: BlockHasher) -> Optional[SubmitRequest]:
        """The request that goes on from what was sent (its blocks named by
        ``block_keys``), or None where it cannot."""
        s = self.original.sampling
        if not failure.resumable or self.finished or self.resumes >= MAX_RESUMES or \
                s.n != 1 or s.prompt_logprobs is not None or \
                len(self.sent_ids) >= s.max_tokens:
            return None
        self.resumes += 1
        ids = self.original.token_ids + self.sent_ids
        return replace(self.original, request_id=f"{self.original.request_id}-resume"
                       f"{self.resumes}", token_ids=ids,
                       block_keys=block_keys(ids, s.adapter),
                       sampling=replace(s, resumed=tuple(self.sent_ids),
                                        resumed_chars=self.sent_chars))
