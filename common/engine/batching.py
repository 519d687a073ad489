"""Which prompt chunks one step computes within a token budget (both the colocated
worker's mixed steps and the prefill worker's batches use it)."""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar


class Prompt(Protocol):
    @property
    def remaining(self) -> int: ...  # tokens still to compute

    aborted: bool


P = TypeVar("P", bound=Prompt)


def plan_chunks(prompts: Sequence[P], budget: int,
                after: Sequence[tuple[P, int]] = ()) -> list[tuple[P, int]]:
    """(prompt, tokens to compute) for one step: oldest prompts first, within ``budget``.

    A prompt that does not fit whole takes what is left of the budget (a chunk); the next
    step continues it. Aborted and finished prompts take nothing. ``after``: plan the step
    that follows that one (a prediction, if no prompt is admitted meanwhile)."""
    computing = {id(p): n for p, n in after}
    out: list[tuple[P, int]] = []
    for p in prompts:
        if budget <= 0:
            break
        remaining = p.remaining - computing.get(id(p), 0)
        if p.aborted or remaining <= 0:
            continue
        n = min(remaining, budget)
        out.append((p, n))
        budget -= n
    return out
