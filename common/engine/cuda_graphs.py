"""Decode steps replayed as CUDA graphs: a step of B sequences is one graph launch instead
of ~350 kernel launches from Python.

At start a graph is captured for each batch size of a ladder (1, 2, 4, 8, then steps of 8
up to max_batch_size, as vLLM and SGLang do); a step of B sequences replays the smallest
captured size >= B, the rows past B padded: token 0 at position 0, a KV row of -1 (the
write kernel skips it) and a length of 0 (attention gives zeros), so a padded row touches
no block. The graphs read their inputs from static device buffers, which one copy per
step fills from a pinned host buffer: token ids, positions, KV rows, lengths, and the
block tables of the real rows only, as wide as the step's longest sequence needs (the
attention kernel reads the tables' row stride from device memory).

Only pure decode steps of a whole model are graphed; mixed steps (colocated mode, prompt
chunks) and pipeline stages stay eager. With ``capture=False`` the same buffers feed an
eager forward of the padded batch: how the tests check the padding and the staging on the
CPU, in Triton's interpreter.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Sequence

import numpy as np
import torch

from common.engine.config import DecodeInput
from common.kv.memory import PagedKVMemory
from common.model.attention import AttnMetadata, TritonAttention
from common.model.decoder import DecoderModel

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
STEP = 8


def batch_ladder(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, 16, 24, ... and ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch_size {max_batch} < 1")
    sizes = [s for s in SMALL_SIZES if s < max_batch]
    sizes += range(2 * STEP, max_batch, STEP)
    return sorted(set(sizes) | {max_batch})


def padded_size(ladder: Sequence[int], n: int) -> int:
    """The smallest captured size that holds ``n`` rows (sequences, a prompt step's
    tokens: common/engine/prompt_graphs.py)."""
    for size in ladder:
        if size >= n:
            return size
    raise ValueError(f"{n} rows exceed the largest captured size {ladder[-1]}")


class DecodeGraphs:
    # offsets of the per-row inputs in the static buffer, in units of max_batch rows
    TOKENS, POSITIONS, ROWS, LENS = range(4)

    def __init__(self, model: DecoderModel, attention: TritonAttention, kv: PagedKVMemory,
                 max_batch: int, max_context: int, capture: bool = True):
        self.model, self.attention, self.kv = model, attention, kv
        self.ladder = batch_ladder(max_batch)
        self.max_batch = self.ladder[-1]
        self.page = kv.block_size
        self.row_step = kv.num_layers * 2 * kv.block_size  # PagedKVMemory.token_rows
        device = kv.data.device
        width = math.ceil(max_context / kv.block_size)  # the most blocks a sequence holds
        # [4 x max_batch per-row inputs | the table stride | tables, up to max_batch rows]
        self.tables_at = 4 * self.max_batch + 1
        size = self.tables_at + self.max_batch * width
        cuda = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=cuda)
        self.host_np = self.host.numpy()  # the same memory, filled with numpy
        self.static = torch.zeros(size, dtype=torch.long, device=device)
        # the host buffer is free again once the last step's copy has read it
        self.copied = torch.cuda.Event() if cuda else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        if capture:
            self._capture()

    def _field(self, buffer: torch.Tensor, which: int, n: int) -> torch.Tensor:
        start = which * self.max_batch
        return buffer[start:start + n]

    def _meta(self, b: int) -> AttnMetadata:
        rows = self._field(self.static, self.ROWS, b)
        return AttnMetadata(
            batch=b, q_len=1, positions=self._field(self.static, self.POSITIONS, b),
            slot_blocks=rows,  # unused: the write takes slot_rows
            block_tables=self.static[self.tables_at:], kv_lens=self._field(
                self.static, self.LENS, b), kv_lens_list=[], mask=None, slot_rows=rows,
            table_stride=self.static[self.tables_at - 1:self.tables_at])

    def _run(self, b: int) -> torch.Tensor:
        tokens = self._field(self.static, self.TOKENS, b)
        hidden = self.model.forward(tokens, self._meta(b), self.attention)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per size, largest first, all in one memory pool (a step runs one at a
        time). Every row is padding while capturing: nothing is written to the KV memory."""
        started = time.perf_counter()
        self._stage([], 1)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the Triton kernels, warms cuBLAS
            for b in self.ladder:
                self._run(b)
        torch.cuda.current_stream().wait_stream(side)
        for b in reversed(self.ladder):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._run(b)
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        log.info("decode CUDA graphs captured for batch sizes %s in %.1f s",
                 ",".join(map(str, self.ladder)), self.capture_s)

    def _stage(self, batch: Sequence[DecodeInput], width: int) -> None:
        """Write a step's inputs to the host buffer (the rows past the batch are padding)
        and copy what the graphs read to the device: the per-row inputs, the stride, and
        ``len(batch)`` rows of ``width`` table entries."""
        if self.copied is not None:
            self.copied.synchronize()
        n, host, page, m = len(batch), self.host_np, self.page, self.max_batch
        positions = np.fromiter((d.position for d in batch), np.int64, n)
        blocks = np.fromiter((d.block_table[p // page] for d, p in zip(batch, positions.tolist())),
                             np.int64, n)
        host[:4 * m].reshape(4, m)[:, n:] = ((0,), (0,), (-1,), (0,))  # padding rows
        host[self.TOKENS * m:][:n] = np.fromiter((d.token_id for d in batch), np.int64, n)
        host[self.POSITIONS * m:][:n] = positions
        host[self.ROWS * m:][:n] = blocks * self.row_step + positions % page
        host[self.LENS * m:][:n] = positions + 1
        host[self.tables_at - 1] = width
        tables = host[self.tables_at:self.tables_at + n * width].reshape(n, width)
        for row, d in zip(tables, batch):
            used = d.block_table[:width]
            row[:len(used)] = used  # the rest is never read (past the length)
        end = self.tables_at + n * width
        self.static[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    @torch.inference_mode()
    def replay(self, batch: Sequence[DecodeInput]) -> torch.Tensor:
        """Logits [len(batch), vocab] (float32) of one decode step (inputs checked by the
        engine): the graph of the smallest captured size that holds the batch."""
        size = padded_size(self.ladder, len(batch))
        width = max(d.position // self.page + 1 for d in batch)
        self._stage(batch, width)
        if size not in self.graphs:  # not captured (tests): the same step, eager
            return self._run(size)[:len(batch)]
        graph, out = self.graphs[size]
        graph.replay()
        return out[:len(batch)].clone()  # the next replay overwrites ``out``
