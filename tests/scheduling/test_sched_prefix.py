"""PrefixIndex (KV events) and the simulator's LRU block cache."""
from __future__ import annotations

from common.scheduling import LRUBlockCache, PrefixIndex


def test_prefix_len_stops_at_first_missing_block() -> None:
    idx = PrefixIndex()
    idx.on_stored([b"a", b"b", b"d"])
    assert idx.prefix_len([b"a", b"b", b"c", b"d"]) == 2
    assert idx.prefix_len([b"x", b"a"]) == 0
    idx.on_removed([b"b"])
    assert idx.prefix_len([b"a", b"b"]) == 1
    assert len(idx) == 2


def test_lru_evicts_least_recently_used_in_order() -> None:
    cache = LRUBlockCache(capacity_blocks=3)
    assert cache.touch([1, 2, 3]) == []
    assert cache.touch([1]) == []          # 2 is now least recent
    assert cache.touch([4, 5]) == [2, 3]
    assert cache.prefix_len([1, 4, 5]) == 3
    assert cache.prefix_len([2, 1]) == 0
    cache.check_integrity()


def test_lru_prefix_len_does_not_touch() -> None:
    cache = LRUBlockCache(capacity_blocks=2)
    cache.touch([1, 2])
    cache.prefix_len([1])                  # a query, not a use
    assert cache.touch([3]) == [1]
    cache.on_removed([2])
    assert len(cache) == 1


def test_policy_code_imports_neither_zmq_nor_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, common.scheduling; "
            "bad = [m for m in ('zmq', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
