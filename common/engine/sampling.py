"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs.

The parameters are common/sampling_params.py's ``SamplingParams``, the very object the
router validated and the wire carried."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from common.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """Row logits with everything outside top-k / top-p set to -inf."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]]) -> tuple[list[int], list[Optional[float]]]:
    """Choose one token per row of logits [B, V]; also its logprob where asked."""
    logits = logits.float()
    tokens: list[int] = []
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    greedy = logits[greedy_rows].argmax(-1).tolist() if greedy_rows else []
    greedy_of = dict(zip(greedy_rows, greedy))
    for i, p in enumerate(params):
        if p.greedy:
            tokens.append(greedy_of[i])
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        tokens.append(int(torch.multinomial(probs, 1, generator=generators[i]).item()))
    logprobs: list[Optional[float]] = [None] * len(params)
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        lp = torch.log_softmax(logits[want], dim=-1)
        for j, i in enumerate(want):
            logprobs[i] = float(lp[j, tokens[i]])
    return tokens, logprobs


class Sampler:
    """Owns the per-request generators: seeded from the request, or from the engine seed."""

    def __init__(self, seed: int = 0):
        self._base = seed
        self._count = 0

    def generator(self, params: SamplingParams, device: str = "cpu") -> Optional[torch.Generator]:
        if params.greedy:
            return None
        self._count += 1
        seed = params.seed if params.seed is not None else self._base * 1_000_003 + self._count
        return torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[Optional[torch.Generator]]) -> tuple[list[int], list[Optional[float]]]:
        return sample(logits, params, generators)
