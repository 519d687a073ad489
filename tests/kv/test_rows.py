"""common/kv/rows.py: pieces copied by a few runs or by row gathers land byte for byte where
a copy per piece puts them, and no piece outside either tensor is ever launched; and
common/kv/dma2d.py's runs (one 2D copy each)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from common.kv import dma2d
from common.kv.rows import (MAX_RUNS, as_arrays, check, coalesce, copy_pieces, copy_rows,
                            on_stream, row_bytes, row_indices)


def reference(src: torch.Tensor, dst: torch.Tensor, pieces) -> torch.Tensor:
    out = dst.clone()
    for s, d, n in pieces:
        out[d:d + n] = src[s:s + n]
    return out


def scattered(count: int, size: int, slots_src: int, slots_dst: int, seed: int):
    rng = random.Random(seed)
    src = rng.sample(range(slots_src), count)
    dst = rng.sample(range(slots_dst), count)
    return [(a * size, b * size, size) for a, b in zip(src, dst)]


@pytest.mark.parametrize("count", [1, MAX_RUNS, MAX_RUNS + 1, 200])
def test_scattered_pieces_land_where_a_copy_per_piece_puts_them(count) -> None:
    src = torch.randint(0, 256, (256 * 64,), dtype=torch.uint8)
    dst = torch.randint(0, 256, (300 * 64,), dtype=torch.uint8)
    pieces = scattered(count, 64, 256, 300, count)
    want = reference(src, dst, pieces)
    assert copy_pieces(src, dst, pieces) == 64 * count
    assert torch.equal(dst, want)


def test_unaligned_pieces_of_different_sizes_use_the_common_row() -> None:
    src = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros(8192, dtype=torch.uint8)
    pieces = [(i * 100 + 12, 8000 - (i + 1) * 120, 36 + 4 * (i % 3)) for i in range(40)]
    assert row_bytes(*as_arrays(pieces), src.numel(), dst.numel()) == 4
    want = reference(src, dst, pieces)
    copy_pieces(src, dst, pieces)
    assert torch.equal(dst, want)


def test_adjacent_pieces_become_one_run() -> None:
    """Whole blocks of consecutive layers, consecutive blocks: one copy, any count."""
    src = torch.randint(0, 256, (64 * 1000,), dtype=torch.uint8)
    dst = torch.zeros(64 * 1200, dtype=torch.uint8)
    pieces = [(i * 64, 6400 + i * 64, 64) for i in range(1000)]
    want = reference(src, dst, pieces)
    copy_pieces(src, dst, pieces, dst_dma=dst)  # the run path copies through dst_dma
    assert torch.equal(dst, want)


def test_row_indices_list_each_piece_s_rows_in_order() -> None:
    s, d = row_indices(*as_arrays([(8, 40, 8), (0, 0, 12)]), 4)
    assert s.tolist() == [2, 3, 0, 1, 2]
    assert d.tolist() == [10, 11, 0, 1, 2]


@pytest.mark.parametrize("piece", [(-4, 0, 4), (0, -4, 4), (0, 0, 0), (60, 0, 8), (0, 124, 8)])
def test_a_piece_outside_either_tensor_is_refused_before_any_copy(piece) -> None:
    src = torch.ones(64, dtype=torch.uint8)
    dst = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(IndexError):
        copy_pieces(src, dst, [(0, 0, 4)] * (MAX_RUNS + 1) + [piece])
    assert not dst.any()  # nothing launched
    with pytest.raises(IndexError):
        check(*as_arrays([piece]), 64, 128)


def test_host_memory_copies_need_no_stream() -> None:
    assert on_stream(None, lambda: 7, after_compute=True) == 7


def test_coalescing_merges_only_pieces_adjacent_on_both_sides() -> None:
    s, d, n = coalesce(*as_arrays([(0, 100, 8), (8, 108, 8), (16, 200, 8), (24, 208, 4)]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 16], [100, 200], [16, 12])


def test_rows_copy_in_bounded_gathers(monkeypatch) -> None:
    import common.kv.rows as rows

    monkeypatch.setattr(rows, "MAX_TEMP_BYTES", 3 * 16)  # three rows of 16 bytes a launch
    src = torch.arange(20 * 16, dtype=torch.int64).view(torch.uint8).view(-1, 16 * 8)
    dst = torch.zeros_like(src)
    order = torch.tensor([4, 0, 9, 2, 7, 1, 3])
    copy_rows(src, dst, order, torch.arange(7))
    assert torch.equal(dst[:7], src[order]) and not dst[7:].any()


@pytest.mark.parametrize("offsets,runs", [
    ([], []),
    ([0], [(0, 1, 0, 64)]),
    ([0, 256, 512, 768], [(0, 4, 0, 256)]),  # objects one after another: one 2D copy
    ([0, 256, 512, 2048, 2304], [(0, 3, 0, 256), (3, 2, 2048, 256)]),
    ([512, 256, 0], [(0, 1, 512, 64), (1, 1, 256, 64), (2, 1, 0, 64)]),  # descending
    ([0, 32, 64], [(0, 1, 0, 64), (1, 1, 32, 64), (2, 1, 64, 64)]),  # pitch below width
    ([0, 100, 200, 250], [(0, 3, 0, 100), (3, 1, 250, 64)]),
    ([0, 1 << 31, 1 << 32], [(0, 1, 0, 64), (1, 1, 1 << 31, 64), (2, 1, 1 << 32, 64)]),  # far
])
def test_2d_runs_group_pieces_at_one_pitch(offsets, runs) -> None:
    """``dma2d.runs``: consecutive pieces at one constant pitch (at least the width) make a
    run, i.e. one 2D copy; anything else starts a new one."""
    assert dma2d.runs(np.asarray(offsets, dtype=np.int64), 64) == runs


def test_long_runs_go_by_copy_engine_however_many() -> None:
    """Past ``MAX_RUNS`` runs, pieces of at least ``DMA_RUN_BYTES`` still go a ``copy_`` per
    run (through the DMA view, as the copy engine would), shorter ones by row gathers."""
    from common.kv.rows import DMA_RUN_BYTES

    for size, by_dma in ((DMA_RUN_BYTES, True), (DMA_RUN_BYTES // 64, False)):
        count = MAX_RUNS + 4
        src = torch.randint(0, 256, (2 * count * size,), dtype=torch.uint8)
        dst = torch.zeros_like(src)
        dma = torch.zeros_like(src)  # the same bytes' other view, in a GPU's case
        pieces = [(2 * i * size, (2 * count - 2 - 2 * i) * size, size) for i in range(count)]
        assert copy_pieces(src, dst, pieces, dst_dma=dma) == count * size
        landed, untouched = (dma, dst) if by_dma else (dst, dma)
        assert torch.equal(landed, reference(src, torch.zeros_like(src), pieces))
        assert not untouched.any()
