"""A prefill worker's queue as the conductor prices it: the prompts placed there whose KV
has not landed, each one's predicted compute, the order the worker takes them in, and the
wait of a new prompt whose prefix one of them computes.

Built when the queue or the cost model's profile changes (``Placer._queue``), not at
every decision: with 2,000 prompts queued over 32 workers a decision took 14-16 ms, most
of it repricing and sorting every queue (1.9-2.1 ms now, ``benchmarks/conductor_scale.py``).
What changes with time alone (the prompts that have waited ``prefill_max_wait_s``, the
part of the first one done) and the online calibration's scales are applied per decision
by ``at``.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional, Sequence

from common.scheduling import CostModel
from common.scheduling.prefill_order import PromptOrder
from common.scheduling.queued import QueuedPrompts
from services.conductor.tracker import Tracked


def shared_prefix(keys: Sequence[str], other: frozenset[str]) -> int:
    """How many leading ``keys`` ``other`` holds. A block's key chains every token before
    it, so the ones it holds are a prefix: a binary search, not a pass over either."""
    if not keys or keys[0] not in other:
        return 0
    lo, hi = 1, len(keys)  # keys[:lo] are held, keys[hi:] are not
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[mid] in other:
            lo = mid + 1
        else:
            hi = mid
    return lo


def queued_waits(keys: Sequence[str], ends: list[tuple[int, float]]) -> dict[str, float]:
    """Each of a request's ``keys`` that prompts queued before it compute, and when the last
    of those is done. ``ends``: per such prompt, how many of ``keys`` it shares (a prefix of
    them: a block's key chains every token before it) and its seconds until done. One pass
    over the keys, not one over every queued prompt's keys (with 2,000 prompts queued that
    took 23 ms of each placement)."""
    out: dict[str, float] = {}
    ends = sorted(ends, reverse=True)
    latest, j = 0.0, 0
    for i in range(ends[0][0] - 1 if ends else -1, -1, -1):
        while j < len(ends) and ends[j][0] > i:  # the prompts computing key i
            latest = max(latest, ends[j][1])
            j += 1
        out[keys[i]] = latest
    return out


@dataclass
class _Group:
    """Queued prompts with the same block keys: one search finds what a new prompt shares
    with all of them (2,000 identical prompts queued had taken a search each)."""

    keys: frozenset[str]
    members: list[int] = field(default_factory=list)  # indices into the queue's waiting
    latest_end: float = float("-inf")  # the latest accept + predicted TTFT of them


class PrefillQueue:
    """``waiting``: the prompts, oldest first; each one's compute by ``cost``'s profile
    (``CostModel.prefill_key`` says when that changed)."""

    def __init__(self, waiting: list[Tracked], cost: CostModel) -> None:
        self.waiting = waiting
        self.prompts = QueuedPrompts([(t.prefill_tokens, cost.profile_prefill_seconds(
            t.prefill_tokens, len(t.req.token_ids) - t.prefill_tokens)) for t in waiting])
        # the first by the worker's order while none has waited too long: fewest tokens
        self.shortest = min(range(len(waiting)),
                            key=lambda i: (waiting[i].prefill_tokens, waiting[i].accepted_at),
                            default=None)
        # the prompts with the same keys (a block's key chains every token before it: the
        # same last key is the same list), by their first key: a new prompt shares keys
        # only with those of its first, and with all of one group as many
        groups: dict[tuple[int, str], _Group] = {}
        for i, t in enumerate(waiting):
            keys = t.req.block_keys
            if keys:
                group = groups.get((len(keys), keys[-1]))
                if group is None:
                    group = groups[len(keys), keys[-1]] = _Group(t.keys)
                group.members.append(i)
                group.latest_end = max(group.latest_end, t.accepted_at + t.predicted_ttft_s)
        self.by_first_key: defaultdict[str, list[_Group]] = defaultdict(list)
        for group in groups.values():
            first_key = waiting[group.members[0]].req.block_keys[0]
            self.by_first_key[first_key].append(group)

    def at(self, now: float, order: PromptOrder, cost: CostModel) -> QueuedPrompts:
        """The queue at ``now``, priced by ``cost``'s live scales: which prompts go by
        their arrival (those that have waited ``max_wait_s``, or all in arrival order),
        which one computes, and what is left of it: done from its predicted start on,
        that is, accept + predicted TTFT - its own compute (its prediction may have been
        late: never less than nothing left)."""
        if not self.waiting:
            return self.prompts
        scales = cost.scales()
        aged = self._aged(now, order)
        first = 0 if aged else self.shortest
        assert first is not None
        t = self.waiting[first]
        own = scales.of_tokens(t.prefill_tokens) * self.prompts.profile[first]
        start = t.accepted_at + t.predicted_ttft_s - own
        return self.prompts.at(scales, aged, first, own - min(own, max(0.0, now - start)))

    def _aged(self, now: float, order: PromptOrder) -> int:
        """How many of the oldest have waited long enough to go by their arrival (the
        waiting are oldest first, so those are a prefix: a binary search)."""
        return bisect_left(self.waiting, True,
                           key=lambda t: not order.aged(t.accepted_at, now))

    def waits_of(self, keys: Sequence[str], prompts: QueuedPrompts,
                 now: float) -> dict[str, float]:
        """Of ``keys`` (a new prompt's), each that a queued prompt computes, and the
        seconds until the last of those is done: its predicted end, or later if it has
        more left to compute than that (``prompts``: this queue ``at`` now)."""
        if not keys or keys[0] not in self.by_first_key:
            return {}
        ends = []
        for group in self.by_first_key[keys[0]]:
            shared = shared_prefix(keys, group.keys)
            if shared:  # the latest of the group to be done
                ends.append((shared, max(group.latest_end - now,
                                         max(map(prompts.seconds, group.members)))))
        return queued_waits(keys, ends)

    def oldest_accepted_at(self) -> Optional[float]:
        return self.waiting[0].accepted_at if self.waiting else None
