"""Which prompt chunks one step computes within a token budget (both the colocated
worker's mixed steps and the prefill worker's batches use it).

With ``align`` (``ClusterConfig.batch_invariant``) a prompt's chunks end only at
multiples of ``align`` tokens or at the prompt's end, and the engine cuts them into
attention parts at the same multiples (``EngineConfig.chunk_align``): a prompt's tokens
are computed in the same pieces alone or under load, however the steps group them, so
its KV and first token do not depend on the load.
"""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class Prompt(Protocol):
    @property
    def remaining(self) -> int: ...  # tokens still to compute

    done: int  # tokens computed (or reused): the next chunk's start
    aborted: bool


P = TypeVar("P", bound=Prompt)


def plan_chunks(prompts: Sequence[P], budget: int,
                after: Sequence[tuple[P, int]] = (), align: int = 0) -> list[tuple[P, int]]:
    """(prompt, tokens to compute) for one step: oldest prompts first, within ``budget``.

    A prompt that does not fit whole takes what is left of the budget (a chunk); the next
    step continues it. With ``align`` the chunk ends at the last multiple of ``align``
    that fits (or the prompt's end); a prompt with no whole piece left to fit waits for
    the next step, except the step's first, which takes its next piece (a step may
    exceed the budget by less than ``align``). Aborted and finished prompts take nothing.
    ``after``: plan the step that follows that one (a prediction, if no prompt is
    admitted meanwhile)."""
    computing = {id(p): n for p, n in after}
    out: list[tuple[P, int]] = []
    for p in prompts:
        if budget <= 0:
            break
        ahead = computing.get(id(p), 0)
        remaining = p.remaining - ahead
        if p.aborted or remaining <= 0:
            continue
        n = min(remaining, budget)
        if align > 0 and n < remaining:
            at = p.done + ahead
            n = (at + budget) // align * align - at
            if n <= 0:
                if out:
                    continue
                n = min(remaining, align - at % align)
        out.append((p, n))
        budget -= n
    return out
