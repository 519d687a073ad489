"""The prompt's own tokens' logprobs: what the completions API's ``echo`` with ``logprobs``
returns for the prompt (lm-evaluation-harness scores a model by them).

A prefill step normally takes logits at one row per prompt (its last, to sample the first
token). A request with ``SamplingParams.prompt_logprobs`` also needs them at every other
row: the row of position p gives the distribution of the token at p + 1. Each chunk's rows
go through the LM head in slices of ``ROWS`` (a [rows, vocab] float32 block: 128 × 49,152
× 4 bytes = 25 MB for SmolLM2), and only the prompt token's logprob and the top k leave
each slice, so a long prompt never holds [prompt, vocab] logits at once. Chunked prefill
gives the chunks in order; ``join`` puts their pieces together.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from common.engine.config import PrefillChunk
from common.sampling_params import PromptLogprobs, TopLogprobs

ROWS = 128  # hidden rows through the LM head at a time


class HasLogits(Protocol):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@torch.inference_mode()
def chunk_logprobs(model: HasLogits, hidden: torch.Tensor, chunk: PrefillChunk,
                   top: int) -> PromptLogprobs:
    """The prompt positions ``chunk`` predicts, ``start + 1`` to ``min(end, n - 1)``, from
    its final hidden states ``hidden`` [end - start, hidden] (before the final norm, as the
    last layer leaves them): each one's prompt-token logprob and, ``top`` > 0, its ``top``
    most likely tokens, best first. The last prompt row predicts no prompt token (it gives
    the first generated one) and is left out."""
    ids = chunk.token_ids
    stop = min(chunk.end, len(ids) - 1)  # rows [start, stop) predict tokens start+1..stop
    logprobs: list[float] = []
    tops: list[TopLogprobs] = []
    for a in range(chunk.start, stop, ROWS):
        b = min(a + ROWS, stop)
        rows = hidden[a - chunk.start:b - chunk.start]
        lp = torch.log_softmax(model.logits(rows).float(), dim=-1)
        wanted = torch.tensor(ids[a + 1:b + 1], dtype=torch.long, device=lp.device)
        logprobs += lp.gather(1, wanted[:, None])[:, 0].tolist()
        if top:
            best = torch.topk(lp, top)
            tops += [TopLogprobs(i, v) for i, v in zip(best.indices.tolist(),
                                                         best.values.tolist())]
        del lp
    return PromptLogprobs(logprobs, tops)


def join(parts: Sequence[PromptLogprobs]) -> PromptLogprobs:
    """The pieces of consecutive chunks, in order, as one."""
    return PromptLogprobs([v for p in parts for v in p.logprobs],
                          [t for p in parts for t in p.top])
