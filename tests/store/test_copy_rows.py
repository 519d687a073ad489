"""common/store/shm.py ``copy_rows``: pieces of equal size between two flat byte arrays,
each to its place, and none written when one lies outside either array."""
from __future__ import annotations

import numpy as np
import pytest

from common.store.shm import copy_rows


def test_copy_rows_moves_each_piece_and_refuses_one_outside() -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(40, dtype=np.uint8)
    copy_rows(dst, np.array([30, 0, 8]), src, np.array([0, 50, 13]), 5)
    want = np.zeros(40, dtype=np.uint8)
    want[30:35], want[0:5], want[8:13] = src[0:5], src[50:55], src[13:18]
    assert np.array_equal(dst, want)
    copy_rows(dst, np.array([], dtype=np.int64), src, np.array([], dtype=np.int64), 5)
    for d, s in (([36], [0]), ([0], [60]), ([-1], [0]), ([0], [-3])):
        with pytest.raises(IndexError):
            copy_rows(dst, np.array(d), src, np.array(s), 5)
    assert np.array_equal(dst, want)  # a refused copy wrote nothing
