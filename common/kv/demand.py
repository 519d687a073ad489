"""A request's KV demand on its decode worker, stated once: the decode worker reserves it
(``services/decode/service.py``) and the conductor places and admits by it
(``services/conductor/placement.py``, ``common/scheduling/admission.py``).

The first sequence holds its prompt and at most ``new_tokens`` more (``max_tokens``, less
a continuation's resumed ones), in whole blocks, up to the model's positions. Each further
choice of ``n`` shares the prompt's full blocks and owns the rest: from the prompt's last
partial block (copied at the fork) to the end of its own output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class KVDemand:
    own: int  # blocks of the first sequence: prompt and output
    tail: int  # blocks each further choice owns
    n: int  # sequences
    block_size: int

    @property
    def blocks(self) -> int:
        return self.own + (self.n - 1) * self.tail

    @property
    def tokens(self) -> int:
        """The KV tokens the blocks hold: what placement compares with free memory."""
        return self.blocks * self.block_size


def kv_demand(prompt_tokens: int, new_tokens: int, n: int, block_size: int,
              max_positions: Optional[int] = None) -> KVDemand:
    """The blocks a prompt of ``prompt_tokens`` and ``n`` sequences of ``new_tokens``
    may hold (``max_positions``: the model's limit, where the caller knows it)."""
    total = prompt_tokens + new_tokens
    if max_positions is not None:
        total = min(total, max_positions)
    own = -(-total // block_size)
    return KVDemand(own, own - min(prompt_tokens // block_size, own), n, block_size)
