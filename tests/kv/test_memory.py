"""Paged KV memory: one contiguous tensor; block and layer byte ranges."""
from __future__ import annotations

import pytest
import torch

from common.kv.memory import PagedKVMemory


def test_layout_and_addresses() -> None:
    m = PagedKVMemory(num_blocks=5, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
    assert m.shape == (5, 3, 2, 4, 2, 8) and m.data.is_contiguous()
    assert m.layer_nbytes == 2 * 4 * 2 * 8 * 4
    assert m.block_nbytes == 3 * m.layer_nbytes
    assert m.nbytes == 5 * m.block_nbytes
    assert m.block_address(2) == m.base_address + 2 * m.block_nbytes
    assert m.layer_address(2, 1) == m.block_address(2) + m.layer_nbytes
    assert m.data[2, 1].data_ptr() == m.layer_address(2, 1)
    assert m.block_bytes(4).numel() == m.block_nbytes


def test_write_and_gather_through_block_table() -> None:
    m = PagedKVMemory(num_blocks=6, num_layers=2, block_size=4, num_kv_heads=2, head_dim=3)
    table = [5, 1, 3]
    k = torch.arange(10 * 6, dtype=torch.float32).view(10, 2, 3)
    v = -k
    pos = torch.arange(10)
    slots = torch.tensor(table)[pos // 4]
    m.write_tokens(1, slots, pos, k, v)
    assert torch.equal(m.data[1, 1, 0, 2], k[6])  # position 6 -> block table[1] = 1, offset 2
    kk, vv = m.gather(1, torch.tensor([table]))
    assert kk.shape == (1, 12, 2, 3)
    assert torch.equal(kk[0, :10], k) and torch.equal(vv[0, :10], v)
    assert m.data[:, 0].abs().sum() == 0  # layer 0 untouched
    raw = m.layer_bytes(5, 1).view(torch.float32).view(2, 4, 2, 3)
    assert torch.equal(raw[0], k[:4])


def test_write_rows_and_gather_into_buffers_match_reference() -> None:
    m = PagedKVMemory(num_blocks=7, num_layers=3, block_size=4, num_kv_heads=2, head_dim=3)
    ref = PagedKVMemory(num_blocks=7, num_layers=3, block_size=4, num_kv_heads=2, head_dim=3)
    tables = torch.tensor([[6, 2, 0], [1, 4, 3]])
    pos = torch.tensor([9, 5])
    slots = tables[torch.arange(2), pos // 4]
    rows = m.token_rows(slots, pos)
    for layer in range(3):
        k = torch.randn(2, 2, 3)
        v = torch.randn(2, 2, 3)
        m.write_rows(layer, rows, k, v)
        ref.write_tokens(layer, slots, pos, k, v)
    assert torch.equal(m.data, ref.data)
    bufs = (torch.full((200,), float("nan")), torch.full((200,), float("nan")))
    for layer in range(3):
        kk, vv = m.gather(layer, tables, out=bufs)
        rk, rv = ref.gather(layer, tables)
        assert kk.shape == rk.shape == (2, 12, 2, 3)
        assert torch.equal(kk, rk) and torch.equal(vv, rv)


def test_copy_blocks_copies_every_layer_of_each_pair() -> None:
    mem = PagedKVMemory(num_blocks=6, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8)
    mem.data.copy_(torch.randn(mem.shape))
    before = mem.data.clone()
    mem.copy_blocks([1, 1, 4], [0, 5, 2])
    for src, dst in ((1, 0), (1, 5), (4, 2)):
        assert torch.equal(mem.data[dst], before[src])
    assert torch.equal(mem.data[[1, 3, 4]], before[[1, 3, 4]])
    mem.copy_blocks([], [])
    with pytest.raises(ValueError, match="2 source blocks for 1"):
        mem.copy_blocks([1, 2], [3])
    with pytest.raises(IndexError):
        mem.copy_blocks([6], [0])
