"""The transfer wrapper over the real Mooncake engine (TCP, loopback)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from common.transfer import TransferAgent, TransferError, coalesce


def test_coalesce_merges_only_adjacent_pairs() -> None:
    assert coalesce([0, 10, 30], [100, 110, 200], [10, 10, 5]) == ([0, 30], [100, 200], [20, 5])
    assert coalesce([0, 10], [100, 120], [10, 10]) == ([0, 10], [100, 120], [10, 10])
    assert coalesce([], [], []) == ([], [], [])


def test_write_and_read_are_byte_exact(agents) -> None:
    a, b = agents
    src = torch.arange(1 << 18, dtype=torch.int32)
    dst = torch.zeros_like(src)
    a.register(src.data_ptr(), src.numel() * 4)
    b.register(dst.data_ptr(), dst.numel() * 4)
    piece = 4096 * 4
    # Write every other piece, out of order.
    idx = [6, 2, 0, 4]
    moved = a.write(b.session_id, [src.data_ptr() + i * piece for i in idx],
                    [dst.data_ptr() + i * piece for i in idx], [piece] * len(idx))
    assert moved == piece * len(idx)
    for i in range(8):
        got = dst[i * 4096:(i + 1) * 4096]
        want = src[i * 4096:(i + 1) * 4096] if i in idx else torch.zeros(4096, dtype=torch.int32)
        assert torch.equal(got, want), i
    back = torch.zeros(4096, dtype=torch.int32)
    a.register(back.data_ptr(), back.numel() * 4)
    a.read(b.session_id, [back.data_ptr()], [dst.data_ptr() + 2 * piece], [piece])
    assert torch.equal(back, src[2 * 4096:3 * 4096])


def test_async_write_has_a_deadline_and_reports_failure(agents) -> None:
    a, b = agents
    src = torch.ones(1024, dtype=torch.uint8)
    a.register(src.data_ptr(), 1024)

    async def go() -> None:
        with pytest.raises(TransferError):
            # Nothing is registered at this remote address on b.
            await a.write_async(b.session_id, [src.data_ptr()], [16], [1024], timeout=10)

    asyncio.run(go())
