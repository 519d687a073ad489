"""The prompt's own logprobs (echo with logprobs), chunk by chunk and in row slices, equal
what the engine gives for each position when it is the last token of a prompt."""
from __future__ import annotations

import pytest
import torch

from common.engine import Engine
from common.engine import prompt_logprobs as pl
from common.engine.config import PrefillChunk

ATOL = 1e-5
K = 3


def _reference(engine: Engine, ids: list[int]) -> tuple[list[float], list[list[int]]]:
    """For positions 1..n-1: log_softmax of the logits after ids[:i] at ids[i], and the
    top K ids there, from ``Engine.prefill`` of each prefix alone."""
    lps, tops = [], []
    for i in range(1, len(ids)):
        blocks = engine.pool.allocate(engine.blocks_needed(i))
        try:
            lp = torch.log_softmax(engine.prefill(ids[:i], blocks).float(), -1)
        finally:
            engine.pool.free(blocks)
        lps.append(lp[ids[i]].item())
        tops.append(torch.topk(lp, K).indices.tolist())
    return lps, tops


@pytest.mark.parametrize("cuts", [[14], [6, 14], [1, 5, 13, 14]])
def test_chunks_in_row_slices_equal_each_prefix_alone(tiny: Engine, cuts: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pl, "ROWS", 4)  # several slices per chunk
    ids = torch.randint(3, 500, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    blocks = tiny.pool.allocate(tiny.blocks_needed(len(ids)))
    parts = []
    try:
        start = 0
        for end in cuts:
            chunk = PrefillChunk(ids, start, end, blocks)
            hidden, _ = tiny.stage_step([chunk])
            parts.append(pl.chunk_logprobs(tiny.model, hidden, chunk, K))
            start = end
    finally:
        tiny.pool.free(blocks)
    got = pl.join(parts)
    want_lps, want_tops = _reference(tiny, ids)
    assert len(got.logprobs) == len(got.top) == len(ids) - 1
    assert got.logprobs == pytest.approx(want_lps, abs=ATOL)
    assert [t.token_ids for t in got.top] == want_tops
    for top, lp in zip(got.top, got.logprobs):
        assert top.logprobs == sorted(top.logprobs, reverse=True) and top.logprobs[0] >= lp


def test_no_alternatives_and_a_one_token_prompt(tiny: Engine) -> None:
    blocks = tiny.pool.allocate(1)
    try:
        chunk = PrefillChunk([5], 0, 1, blocks)
        hidden, _ = tiny.stage_step([chunk])
        assert pl.chunk_logprobs(tiny.model, hidden, chunk, 0).logprobs == []  # position 0
        chunk = PrefillChunk([5, 6, 7], 0, 3, blocks)
        hidden, _ = tiny.stage_step([chunk])
        got = pl.chunk_logprobs(tiny.model, hidden, chunk, 0)
        assert len(got.logprobs) == 2 and got.top == []
    finally:
        tiny.pool.free(blocks)
