"""Where each block of a prompt comes from, and which blocks go back to the store: the
reuse policy as pure decisions (no pool, no store client, no asyncio).

``services/prefill/prefix.py`` asks the local pool and the store and executes these
decisions. Block ``i`` of a prompt holds tokens ``[i * block_size, (i + 1) * block_size)``;
only full blocks have keys, so only they can be reused or stored. The steps:

1. the local cache's hits, ``[0, local)``;
2. if the store is on and a full block is still missing: the store's ``exists`` answers for
   every key, and ``store_fetch`` — the blocks after the local hits up to the store's first
   miss (a hole ends the prefix);
3. ``plan_reuse`` — of the blocks present (local, then those fetched intact), the leading
   ones kept so that at least one token is left to compute (its logits give the first
   token); the rest of the prompt's blocks are fresh, computed into;
4. after the prefill, ``put_back`` — the full blocks not known to be in the store.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


def leading(flags: Sequence[bool]) -> int:
    """How many answers are true before the first false one."""
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def ask_store(local: int, full_blocks: int, store_on: bool) -> bool:
    """The store is asked only when it is on and the local cache missed a full block."""
    return store_on and local < full_blocks


def store_fetch(local: int, exists: Sequence[bool]) -> range:
    """Blocks to copy from the store: after the local hits, up to the store's first miss."""
    return range(local, max(local, leading(exists)))


@dataclass(frozen=True)
class Reuse:
    """A prompt's blocks by origin: ``[0, local)`` hit locally, ``[local, local + loaded)``
    loaded from the store now, of which the leading ``kept`` are reused; ``[kept, total)``
    are fresh blocks to compute into."""

    local: int
    loaded: int
    kept: int
    total: int
    stored_from: int  # first block index not known to be in the store

    @property
    def dropped(self) -> int:
        """Blocks found but given back so that a token is left to compute."""
        return self.local + self.loaded - self.kept

    @property
    def fresh(self) -> int:
        return self.total - self.kept

    @property
    def global_blocks(self) -> int:
        """Reused blocks that came from the store for this request."""
        return max(0, self.kept - self.local)


def plan_reuse(num_tokens: int, block_size: int, local: int, loaded: int,
               store_prefix: Optional[int]) -> Reuse:
    """Which of the blocks found are reused. ``loaded``: leading blocks fetched intact from
    the store; ``store_prefix``: the store's answer (``leading(exists)``), None when it was
    not asked or did not answer."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0 or local < 0 or loaded < 0:
        raise ValueError(f"negative count: tokens {num_tokens}, local {local}, "
                         f"loaded {loaded}")
    if local * block_size > num_tokens:
        raise ValueError(f"{local} local blocks for only {num_tokens} tokens")
    if loaded > max(0, (store_prefix or 0) - local):
        raise ValueError(f"{loaded} blocks loaded beyond the store's prefix {store_prefix} "
                         f"after {local} local hits")
    # At least one token must be computed to produce the first token's logits.
    kept = max(0, min(local + loaded, (num_tokens - 1) // block_size))
    total = -(-num_tokens // block_size)
    return Reuse(local, loaded, kept, total, stored_from=max(local, store_prefix or 0))


def put_back(stored_from: int, full_blocks: int, store_on: bool) -> range:
    """Full blocks to put into the store after the prefill: those not known to be there."""
    return range(stored_from, full_blocks) if store_on else range(0)
