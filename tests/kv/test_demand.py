"""A request's KV demand: exact cases of the one formula the decode worker reserves by and
the conductor places by."""
from __future__ import annotations

import pytest

from common.kv.demand import kv_demand
from common.protocol import SubmitRequest
from common.sampling_params import SamplingParams
from services.conductor.placement import kv_tokens


@pytest.mark.parametrize("prompt, new, n, limit, own, tail", [
    (40, 8, 1, None, 3, 1),    # 48 tokens: 3 blocks; a further choice owns 48-32 → 1
    (32, 8, 1, None, 3, 1),    # a full last prompt block: the output starts a new one
    (32, 0, 2, None, 2, 0),    # nothing to add: further choices own nothing
    (40, 100, 3, None, 9, 7),  # 140 tokens: 9 blocks, 2 of them the prompt's full ones
    (40, 100, 1, 64, 4, 2),    # the model's positions cap the output
])
def test_blocks_of_a_prompt_and_its_choices(prompt: int, new: int, n: int, limit, own: int,
                                            tail: int) -> None:
    d = kv_demand(prompt, new, n, 16, limit)
    assert (d.own, d.tail, d.n) == (own, tail, n)
    assert d.blocks == own + (n - 1) * tail and d.tokens == d.blocks * 16


def test_the_conductor_counts_what_the_worker_reserves() -> None:
    """Placement's tokens are the reservation's blocks, a continuation's resumed tokens
    already generated: not the prompt plus n x max_tokens."""
    resumed = SamplingParams(max_tokens=20, n=1, resumed=(5, 6, 7, 8))
    req = SubmitRequest("r", list(range(44)), [], resumed, 0.0)
    assert kv_tokens(req, 16) == kv_demand(44, 16, 1, 16).tokens == 4 * 16
    three = SubmitRequest("r3", list(range(40)), [], SamplingParams(max_tokens=8, n=3), 0.0)
    assert kv_tokens(three, 16) == (3 + 2) * 16
