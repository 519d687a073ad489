"""Prompt steps as piecewise CUDA graphs: what the layers compute between two attentions
is replayed; the attentions run as before, between the replays.

On a GPU a short prompt step is bound by its launches from Python: a warm 4k prompt's
tenth (416 tokens after 3,680 cached) took 27-40 ms on an H200 whose card was busy 13.7
ms of it (BENCHMARKS.md, issue 26), at ~14 launches a layer. Here piece i holds layer
i-1's output projection, MLP and norms and layer i's QKV projection, q/k norms and rope
(piece 0 the embedding and layer 0's, the last piece the last layer's back): one replay
instead of ~9 launches. The attention stays eager, since its keys (the cached prefix, the
step's parts) differ from step to step, as in vLLM's piecewise graphs.

Graphs are captured at start for a ladder of token counts up to ``max_tokens``; a step of
T tokens replays the smallest size >= T, the rows past T padding (token 0 at position 0).
Linears and norms treat each row alone and the attention gets the real rows only, so the
padding writes no KV and changes no real row. The pieces read and write static buffers:
the tokens and positions (one copy a step from a pinned host buffer), the residual stream
h, the layer's q, k, v and the attention's output o. Steps of more tokens, pipeline stages
and CPU engines run the model's forward. With ``capture=False`` the same pieces run
eagerly on the same buffers: how the tests check them on the CPU.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from common.engine.cuda_graphs import padded_size
from common.model.attention import AttentionBackend, AttnMetadata
from common.model.decoder import DecoderModel

log = logging.getLogger(__name__)

# Token counts captured (those below max_tokens, then max_tokens): from 64 tokens on a
# step pads at most a third of its rows
SIZES = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024,
         1280, 1536, 2048)


def token_ladder(max_tokens: int) -> list[int]:
    if max_tokens < 1:
        raise ValueError(f"prompt graphs need max_tokens >= 1, not {max_tokens}")
    return [s for s in SIZES if s < max_tokens] + [max_tokens]


class PromptGraphs:
    def __init__(self, model: DecoderModel, max_tokens: int, capture: bool = True) -> None:
        if not (model.first_stage and model.last_stage):
            raise ValueError("prompt graphs replay a whole model, not a pipeline stage")
        self.model = model
        self.ladder = token_ladder(max_tokens)
        self.max_tokens = m = self.ladder[-1]
        cfg, device, dtype = model.config, model.device, model.dtype
        cuda = device.type == "cuda"
        self.host = torch.zeros(2 * m, dtype=torch.long, pin_memory=cuda)  # tokens | positions
        self.host_np = self.host.numpy()
        self.static = torch.zeros(2 * m, dtype=torch.long, device=device)
        self.copied = torch.cuda.Event() if cuda else None  # the host buffer is free again

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(m, *shape, dtype=dtype, device=device)
        self.h = buffer(cfg.hidden_size)
        self.q = buffer(cfg.num_heads, cfg.head_dim)
        self.k, self.v = buffer(cfg.num_kv_heads, cfg.head_dim), buffer(cfg.num_kv_heads,
                                                                         cfg.head_dim)
        self.o = buffer(cfg.num_heads * cfg.head_dim)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.running = 0  # the rows of the step in flight (a nested one saves them)
        self.capture_s = 0.0
        if capture:
            self._capture()

    def _piece(self, i: int, n: int) -> None:
        """Piece ``i`` of a step of ``n`` rows: the embedding and layer 0's front (i = 0),
        layer i-1's back and layer i's front, or the last layer's back (i = layers)."""
        m = self.model
        if i == 0:
            h = m.embed_tokens(self.static[:n])
            x: Optional[torch.Tensor] = m.ops.rms_norm(h, m.layers[0].input_norm,
                                                       m.config.rms_norm_eps)
        else:
            h, x = m.back(i - 1, self.h[:n], self.o[:n])
        self.h[:n].copy_(h)
        if x is not None:
            positions = self.static[self.max_tokens:self.max_tokens + n]
            q, k, v = m.front(i, x, m.ropes(positions))
            self.q[:n].copy_(q)
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Every piece of every size, largest first, in one memory pool: a piece keeps
        nothing of its own past its replay (its results are in the static buffers), and
        a step replays one piece at a time. All rows are padding while capturing."""
        started = time.perf_counter()
        self._stage([], [], self.max_tokens)
        pieces = len(self.model.layers) + 1
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles the Triton kernels, warms cuBLAS
            for n in self.ladder:
                for i in range(pieces):
                    self._piece(i, n)
        torch.cuda.current_stream().wait_stream(side)
        for n in reversed(self.ladder):
            graphs = []
            for i in range(pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(i, n)
                graphs.append(graph)
            self.graphs[n] = graphs
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        log.info("prompt CUDA graphs captured for %s tokens (%d pieces each) in %.1f s",
                 ",".join(map(str, self.ladder)), pieces, self.capture_s)

    def _stage(self, ids: Sequence[int], positions: Sequence[int], n: int) -> None:
        """The step's tokens and positions to the device, rows past them up to ``n`` 0."""
        if self.copied is not None:
            self.copied.synchronize()
        t, m, host = len(ids), self.max_tokens, self.host_np
        host[t:n] = 0
        host[m + t:m + n] = 0
        host[:t] = np.asarray(ids, dtype=np.int64)
        host[m:m + t] = np.asarray(positions, dtype=np.int64)
        self.static[:m + n].copy_(self.host[:m + n], non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    @torch.inference_mode()
    def forward(self, ids: Sequence[int], positions: Sequence[int], meta: AttnMetadata,
                attention: AttentionBackend,
                layer_hook: Optional[Callable[[int], None]] = None,
                before_layer: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """``DecoderModel.forward`` of a step's ``ids`` at ``positions`` (``meta``'s) by the
        graph of the smallest captured size that holds them: hidden states [T, hidden].
        ``before_layer(i)`` runs right before layer i's attention (after its front, which
        reads no KV memory), ``layer_hook(i)`` after its back, as in the model's forward."""
        outer = self.running  # a step paused at its layer boundary (services/prefill/
        # preempt.py: a short prompt's step runs in its hook): its rows are put back after
        saved = [(b, b[:outer].clone()) for b in (self.h, self.q, self.k, self.v)] + [
            (self.static, self.static.clone())] if outer else []  # tokens | positions
        self.running = padded_size(self.ladder, len(ids))
        try:
            return self._forward(ids, positions, meta, attention, layer_hook, before_layer)
        finally:
            self.running = outer
            for buffer, rows in saved:
                buffer[:len(rows)].copy_(rows)

    def _forward(self, ids: Sequence[int], positions: Sequence[int], meta: AttnMetadata,
                 attention: AttentionBackend, layer_hook: Optional[Callable[[int], None]],
                 before_layer: Optional[Callable[[int], None]]) -> torch.Tensor:
        t, n = len(ids), self.running
        self._stage(ids, positions, n)
        graphs = self.graphs.get(n)

        def run(i: int) -> None:
            if graphs is None:  # not captured (tests): the same piece, eager
                self._piece(i, n)
            else:
                graphs[i].replay()
        run(0)
        for i, lw in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            o = attention(i, self.q[:t], self.k[:t], self.v[:t], meta, lw.attn)
            self.o[:t].copy_(o)
            run(i + 1)
            if layer_hook is not None:
                layer_hook(i)
        return self.h[:t].clone()  # the next step overwrites the buffer


def prompt_graphs(model: DecoderModel, max_tokens: int) -> Optional[PromptGraphs]:
    """A whole model's prompt graphs, captured; None for a pipeline stage, a mixture of
    experts (which experts run is data) or latent attention (not yet tried), or where
    the capture fails (logged: its prompt
    steps run the model's forward)."""
    if (not (model.first_stage and model.last_stage) or model.config.num_experts
            or model.config.kv_lora_rank):
        return None
    try:
        return PromptGraphs(model, max_tokens)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
        log.warning("prompt CUDA graphs not captured (%s): prompt steps run eagerly", exc)
        torch.cuda.empty_cache()
        return None
