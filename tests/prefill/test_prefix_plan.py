"""The prefix reuse plan, pure: which blocks are reused locally, loaded from the store,
computed and put back, for every shape of hit (block size 4 throughout)."""
from __future__ import annotations

import pytest

from services.prefill.prefix_plan import (
    Reuse, ask_store, leading, plan_reuse, put_back, store_fetch,
)

T, F = True, False


def test_leading_counts_up_to_the_first_miss() -> None:
    assert leading([]) == 0
    assert leading([F, T, T]) == 0
    assert leading([T, T, F, T]) == 2
    assert leading([T, T, T]) == 3


def test_the_store_is_asked_only_when_on_and_a_full_block_is_missing() -> None:
    assert ask_store(local=1, full_blocks=3, store_on=True)
    assert not ask_store(local=3, full_blocks=3, store_on=True)  # local covers them all
    assert not ask_store(local=0, full_blocks=3, store_on=False)
    assert not ask_store(local=0, full_blocks=0, store_on=True)  # no full block at all


# (tokens, local hits, store on, its exists answers or None (not asked or no answer),
#  blocks fetched intact) → (blocks to fetch, the Reuse, blocks to put back)
CASES = {
    "no hits, store off": (10, 0, False, None, 0, None, Reuse(0, 0, 0, 3, 0), range(0)),
    "no hits, store empty": (10, 0, True, [F, F], 0, range(0, 0), Reuse(0, 0, 0, 3, 0),
                             range(0, 2)),
    "local hits only": (10, 2, True, None, 0, None, Reuse(2, 0, 2, 3, 2), range(2, 2)),
    "store extends local": (17, 1, True, [T, T, T, F], 2, range(1, 3), Reuse(1, 2, 3, 5, 3),
                            range(3, 4)),
    # A hole ends the store's prefix: blocks after it are computed and put, even if stored.
    "hole in the store": (17, 0, True, [T, F, T, T], 1, range(0, 1), Reuse(0, 1, 1, 5, 1),
                          range(1, 4)),
    "store behind local": (17, 3, True, [T, F, F, F], 0, range(3, 3), Reuse(3, 0, 3, 5, 3),
                           range(3, 4)),
    # Block-aligned: the last hit is dropped so that a token is computed (its logits).
    "aligned, local": (12, 3, True, None, 0, None, Reuse(3, 0, 2, 3, 3), range(3, 3)),
    "aligned, stored": (12, 1, True, [T, T, T], 2, range(1, 3), Reuse(1, 2, 2, 3, 3),
                        range(3, 3)),
    "partial last block": (13, 3, True, None, 0, None, Reuse(3, 0, 3, 4, 3), range(3, 3)),
    "one block prompt": (4, 1, True, None, 0, None, Reuse(1, 0, 0, 1, 1), range(1, 1)),
    "one token": (1, 0, True, None, 0, None, Reuse(0, 0, 0, 1, 0), range(0, 0)),
    # The copy of block 2 failed: 2 and 3 are computed, not put (the store has them).
    "copy failed": (17, 1, True, [T, T, T, T], 1, range(1, 4), Reuse(1, 1, 2, 5, 4),
                    range(4, 4)),
    "nothing to copy into": (17, 1, True, [T, T, T, T], 0, range(1, 4),
                             Reuse(1, 0, 1, 5, 4), range(4, 4)),
    "store did not answer": (17, 1, True, None, 0, None, Reuse(1, 0, 1, 5, 1), range(1, 4)),
}


@pytest.mark.parametrize("case", CASES)
def test_reuse_plan(case: str) -> None:
    tokens, local, store_on, exists, loaded, fetch, reuse, put = CASES[case]
    full = tokens // 4
    if exists is not None:  # an answer means the store was asked
        assert ask_store(local, full, store_on)
        assert store_fetch(local, exists) == fetch
    got = plan_reuse(tokens, 4, local, loaded, None if exists is None else leading(exists))
    assert got == reuse
    assert put_back(got.stored_from, full, store_on) == put
    assert got.kept + got.fresh == got.total
    assert got.dropped == local + loaded - got.kept


def test_derived_counts() -> None:
    aligned = plan_reuse(12, 4, local=1, loaded=2, store_prefix=3)
    assert (aligned.fresh, aligned.dropped, aligned.global_blocks) == (1, 1, 1)
    extended = plan_reuse(17, 4, local=1, loaded=2, store_prefix=3)
    assert (extended.fresh, extended.dropped, extended.global_blocks) == (2, 0, 2)
    assert plan_reuse(0, 4, 0, 0, None) == Reuse(0, 0, 0, 0, 0)


def test_store_off_puts_nothing_back() -> None:
    assert put_back(0, 4, store_on=False) == range(0)
    assert put_back(5, 4, store_on=True) == range(5, 4)  # empty: all known stored


@pytest.mark.parametrize("args, match", [
    ((10, 0, 0, 0, None), "block_size must be positive"),
    ((10, 4, -1, 0, None), "negative count"),
    ((10, 4, 3, 0, None), "3 local blocks for only 10 tokens"),
    ((17, 4, 1, 3, 3), "3 blocks loaded beyond the store's prefix 3 after 1 local hits"),
    ((17, 4, 0, 1, None), "1 blocks loaded beyond the store's prefix None"),
])
def test_impossible_inputs_are_rejected(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_reuse(*args)
