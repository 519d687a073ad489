"""Which prompt chunks one step computes within a token budget (both the colocated
worker's mixed steps and the prefill worker's batches use it).

With ``align`` (``ClusterConfig.batch_invariant``) a prompt's chunks end only at
multiples of ``align`` tokens or at the prompt's end, whatever else the step holds: a
prompt is computed in the same pieces alone or under load, so its KV and first token do
not depend on the load (the attention of a chunk depends on the chunk's bounds).
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
    step continues it. With ``align`` a chunk runs to the prompt's next multiple of
    ``align`` (or its end): a prompt whose chunk does not fit what is left waits for the
    next step, except the step's first, which is taken whole (a step may exceed the
    budget by less than ``align``). Aborted and finished prompts take nothing. ``after``:
    plan the step that follows that one (a prediction, if no prompt is admitted
    meanwhile)."""
    computing = {id(p): n for p, n in after}
    out: list[tuple[P, int]] = []
    for p in prompts:
        if budget <= 0:
            break
        ahead = computing.get(id(p), 0)
        remaining = p.remaining - ahead
        if p.aborted or remaining <= 0:
            continue
        if align > 0:
            n = min(remaining, align - (p.done + ahead) % align)
            if n > budget and out:
                continue
        else:
            n = min(remaining, budget)
        out.append((p, n))
        budget -= n
    return out
