"""The engine every worker runs: model + paged KV memory + block pool.

Prefill computes one sequence (optionally past a cached prefix, in chunks, calling a
per-layer hook); decode_step advances a batch of sequences of different lengths by one
token each in one forward pass. Both write K/V into the caller's blocks.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence

import torch

from common.config import QUANTIZATIONS
from common.engine.config import DecodeInput, EngineConfig, PrefillChunk, stage_layers
from common.engine.cuda_graphs import DecodeGraphs
from common.engine.errors import EngineInputError, UnknownModelError
from common.engine.profiling import StepProfiler
from common.engine.prompt_graphs import prompt_graphs
from common.engine.step_meta import StepMeta, mixed
from common.kv.block_keys import adapter_fingerprint, compute_block_keys, model_fingerprint
from common.kv.block_pool import BlockPool
from common.kv.dtypes import resolve_kv_dtype
from common.kv.memory import KV_DTYPES, PagedKVMemory
from common.model.arch import UnsupportedModelError
from common.model.attention import AttnMetadata, TritonAttention, make_backend
from common.model.config import ModelConfig
from common.model.decoder import DecoderModel
from common.model.dummy_weights import random_weights
from common.model.loader import ModelNotFoundError, load_model_source
from common.model.lora import AdapterError, LoraRows, load_adapter
from common.model.quant import quantize_matrices
from common.model.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# what linears may multiply in: int8, a quantized model's codes times its inputs rounded
# to int8 (common/model/linear.py Linear)
_LINEAR_DTYPES = {**_DTYPES, "int8": torch.int8}
LayerHookFn = Callable[[int, int, int], None]


Built = tuple[ModelConfig, DecoderModel, Optional[dict]]  # + the tokenizer's spec
# Models built ahead, by prebuild(): the fork server's (launch/forkserver.py), whose
# forked workers share its weights instead of each loading and packing its own
_PREBUILT: dict[tuple, Built] = {}


def _model_key(config: EngineConfig) -> tuple:
    return (config.model, config.num_layers, config.dtype, config.linear_dtype, config.device,
            config.stage, config.quantization, config.lora_modules)


def build_model(config: EngineConfig) -> Built:
    """Load ``config``'s model and build its stage's layers in its dtype on its device."""
    try:
        model_config, weights, tok_spec = load_model_source(config.model, config.num_layers)
    except (ModelNotFoundError, UnsupportedModelError) as e:
        raise UnknownModelError(str(e)) from e
    identity = model_config.weights_id  # what quantizing its weights at load is cached by
    if not weights:
        weights = random_weights(model_config, seed=0)
        # a dummy's seeded weights: its shape names them (each worker of a quantized dummy
        # maps one cached copy instead of rounding 8B weights itself, ~85 s, in memory)
        identity = "random-seed0-" + model_fingerprint(model_config).hex()
    try:
        if config.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not "
                             f"{config.quantization!r}")
        layers = stage_layers(model_config.num_layers, config.stage[1], config.stage[0])
        if config.quantization in ("q8_0", "q4_0"):
            weights = quantize_matrices(weights, config.quantization, layers, identity)
        model = DecoderModel(model_config, weights, _DTYPES[config.dtype],
                             torch.device(config.device), layers=layers,
                             linear_dtype=_LINEAR_DTYPES[config.linear_dtype]
                             if config.linear_dtype else None,
                             quantized=config.quantization != "none")
    except ValueError as exc:
        raise EngineInputError(str(exc)) from exc
    try:
        model.adapters = {name: load_adapter(name, path, model)
                          for name, path in config.lora_modules}
    except (AdapterError, OSError) as exc:
        raise UnknownModelError(f"LoRA adapter: {exc}") from exc
    for name, adapter in model.adapters.items():
        log.info("LoRA adapter %s: rank up to %d, %d of this stage's %d layers", name,
                 adapter.rank, len(adapter.layers), len(layers))
    if model.expanded_quantized:
        log.info("%s: %.2fB parameters of quantized matrices expanded to %s linears (%s); "
                 "float32 linears on a CPU with AVX-512 keep them quantized", config.model,
                 model.expanded_quantized / 1e9, config.linear_dtype or config.dtype,
                 f"quantization {config.quantization}" if config.quantization == "none"
                 else f"dtype {config.dtype}, linear_dtype {config.linear_dtype}, "
                 f"device {config.device}")
    return model_config, model, tok_spec


def prebuild(config: EngineConfig) -> None:
    """Build ``config``'s model now, for every engine of the same model, dtype, device and
    stage made later in this process or in a process forked from it (a CPU model only: a
    fork does not carry CUDA memory). The model is read-only once built."""
    if torch.device(config.device).type != "cpu":
        raise ValueError(f"only a CPU model is built ahead, not one on {config.device}")
    _PREBUILT[_model_key(config)] = build_model(config)


class Engine:
    def __init__(self, config: EngineConfig):
        if config.dtype not in _DTYPES:
            raise EngineInputError(f"unknown dtype {config.dtype!r} ({sorted(_DTYPES)})")
        if (config.linear_dtype or config.dtype) not in _LINEAR_DTYPES:
            raise EngineInputError(f"unknown linear_dtype {config.linear_dtype!r} "
                                   f"({sorted(_LINEAR_DTYPES)})")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.dtype = _DTYPES[config.dtype]
        try:
            self.kv_dtype: str = resolve_kv_dtype(config.dtype, config.kv_dtype)
        except ValueError as exc:
            raise EngineInputError(str(exc)) from exc
        self.device = torch.device(config.device)
        model_config, self.model, tok_spec = _PREBUILT.get(_model_key(config)) or \
            build_model(config)
        self.model_config: ModelConfig = model_config
        self.layers = self.model.layer_range  # a pipeline stage's layers [a, b) of the model
        self.tokenizer = (Tokenizer(tok_spec) if tok_spec is not None
                          else ByteTokenizer(model_config.vocab_size))
        self.fingerprint: bytes = model_fingerprint(model_config, self.kv_dtype,
                                                      config.quantization)
        # each adapter's blocks under keys of their own (None: the base model's)
        self.fingerprints: dict[Optional[str], bytes] = {None: self.fingerprint, **{
            name: adapter_fingerprint(self.fingerprint, path)
            for name, path in config.lora_modules}}
        self.kv = PagedKVMemory(config.num_blocks, len(self.layers), config.block_size,
                                model_config.num_kv_heads, model_config.head_dim,
                                KV_DTYPES[self.kv_dtype], self.device, config.kv_shm_path)
        self.pool = BlockPool(config.num_blocks)
        self.attention = make_backend(config.attention_backend, self.kv,
                                      prompt_rows=config.chunk_align > 0)
        self.meta = StepMeta(config.block_size, self.device, self.dtype, self.kv,
                             self.attention.decode_mask)
        self.profiler = StepProfiler(None, "engine", 0)  # off: a worker sets its own (env)
        # (kind, seconds, sequences, tokens) of each step: a worker's metrics (common/worker.py)
        self.on_step: Optional[Callable[[str, float, int, int], None]] = None
        self.graphs: Optional[DecodeGraphs] = None
        if (config.cuda_graphs and self.device.type == "cuda" and self.model.graphable
                and len(self.layers) == model_config.num_layers
                and isinstance(self.attention, TritonAttention)):
            self.graphs = DecodeGraphs(self.model, self.attention, self.kv,
                                       config.max_batch_size, self.max_context)
        self.prompt_graphs = prompt_graphs(self.model, config.prompt_graph_tokens) \
            if config.prompt_graph_tokens and self.device.type == "cuda" else None

    # ---- text -----------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode_tokens(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def block_keys(self, token_ids: Sequence[int], adapter: Optional[str] = None
                   ) -> list[bytes]:
        self._check_adapter(adapter)
        return compute_block_keys(token_ids, self.config.block_size, self.fingerprints[adapter])

    def _check_adapter(self, adapter: Optional[str]) -> None:
        if adapter not in self.fingerprints:
            raise EngineInputError(f"no LoRA adapter {adapter!r} here (serving "
                                   f"{sorted(n for n in self.fingerprints if n) or 'none'})")

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.config.block_size)

    @property
    def max_context(self) -> int:
        return min(self.model_config.max_position_embeddings,
                   self.config.num_blocks * self.config.block_size)

    # ---- validation -----------------------------------------------------------------
    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) == 0:
            raise EngineInputError("prompt is empty: at least one token is required")
        if len(token_ids) > self.max_context:
            raise EngineInputError(f"prompt has {len(token_ids)} tokens, more than the context "
                                   f"limit of {self.max_context}")
        self._check_token_ids(token_ids)

    def _check_token_ids(self, token_ids: Sequence[int]) -> None:
        vocab = self.model_config.vocab_size
        # in C first (a 16k prompt: 0.7 ms, the loop 1.0); the loop names a bad id
        if set(map(type, token_ids)) == {int} and 0 <= min(token_ids) and max(token_ids) < vocab:
            return
        for t in token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise EngineInputError(f"token id {t!r} is outside the vocabulary [0, {vocab})")

    def _check_block_table(self, block_table: Sequence[int], num_tokens: int) -> None:
        need = self.blocks_needed(num_tokens)
        if len(block_table) < need:
            raise EngineInputError(f"block table has {len(block_table)} blocks; "
                                   f"{num_tokens} tokens need {need}")
        used = block_table[:need]
        if used and not (0 <= min(used) and max(used) < self.config.num_blocks):
            bad = next(b for b in used if not 0 <= b < self.config.num_blocks)
            raise EngineInputError(f"block id {bad} outside [0, {self.config.num_blocks})")

    # ---- forward --------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, token_ids: list[int], block_table: list[int], num_cached_tokens: int = 0,
                layer_hook: Optional[LayerHookFn] = None, adapter: Optional[str] = None,
                ) -> torch.Tensor:
        """Compute KV of token_ids[num_cached_tokens:] into block_table; logits [vocab] of
        the last position. layer_hook(layer, start, end) runs after each layer of each chunk.
        ``adapter``: the LoRA adapter it runs on."""
        self.validate_prompt(token_ids)
        self._check_adapter(adapter)
        n = len(token_ids)
        self._check_block_table(block_table, n)
        if not 0 <= num_cached_tokens <= n:
            raise EngineInputError(f"num_cached_tokens {num_cached_tokens} not in [0, {n}]")
        start = min(num_cached_tokens, n - 1)  # the last token is always computed for logits
        chunk = max(1, self.config.prefill_chunk)
        logits: Optional[torch.Tensor] = None
        for s in range(start, n, chunk):
            e = min(s + chunk, n)
            hook = None if layer_hook is None else (lambda l, s=s, e=e: layer_hook(l, s, e))
            logits = self._forward([PrefillChunk(token_ids, s, e, block_table, adapter)], [],
                                   hook)[0][0]
        assert logits is not None
        return logits

    @torch.inference_mode()
    def step(self, chunks: Sequence[PrefillChunk] = (), decodes: Sequence[DecodeInput] = (),
             layer_hook: Optional[Callable[[int], None]] = None,
             ) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
        """One mixed forward (Sarathi-style): prefill chunks of several prompts and one
        token of each decoding sequence. The linear layers run once over all tokens.

        Returns (logits [vocab] per chunk, None unless the chunk ends its prompt;
        decode logits [len(decodes), vocab] or None). Prompts must have been validated
        (``validate_prompt``) when they were admitted; ranges and tables are checked here.
        layer_hook(layer) runs after each layer."""
        if not chunks and not decodes:
            raise EngineInputError("a step needs at least one prefill chunk or decode")
        if len(self.layers) != self.model_config.num_layers:
            raise EngineInputError(f"a pipeline stage (layers {self.layers.start}-"
                                   f"{self.layers.stop - 1}) runs stage_step, not step")
        self._check_chunks(chunks)
        self._check_decodes(decodes)
        with self._timed(chunks, decodes):
            return self._forward(chunks, decodes, layer_hook)

    @torch.inference_mode()
    def stage_step(self, chunks: Sequence[PrefillChunk], hidden: Optional[torch.Tensor] = None,
                   layer_hook: Optional[Callable[[int], None]] = None,
                   before_layer: Optional[Callable[[int], None]] = None,
                   ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """A pipeline stage's share of a prefill step: this stage's layers over the chunks,
        starting from the previous stage's ``hidden`` states (the first stage embeds).
        Returns (hidden states [T, hidden] out of its last layer, logits per chunk: those
        ending their prompt, on the last stage only). Hooks take the stage-local layer."""
        if not chunks:
            raise EngineInputError("a stage step needs at least one prefill chunk")
        self._check_chunks(chunks)
        tokens = sum(c.end - c.start for c in chunks)
        if not self.model.first_stage and (hidden is None or hidden.shape != (
                tokens, self.model_config.hidden_size)):
            got = None if hidden is None else tuple(hidden.shape)
            raise EngineInputError(f"stage at layer {self.layers.start} needs hidden states "
                                   f"[{tokens}, {self.model_config.hidden_size}], got {got}")
        # CRESCENT_PROFILE_DIR only: a chunk after a cached prefix is labelled by where it starts
        with self._timed(chunks, ()), self.profiler.step(
                f"{tokens}t-after{max(c.start for c in chunks)}", self.device):
            out = self._hidden(chunks, (), layer_hook, hidden, before_layer)
            if not self.model.last_stage:
                return out, [None] * len(chunks)
            return out, self._logits(out, chunks, ())[0]

    @contextmanager
    def _timed(self, chunks: Sequence[PrefillChunk], decodes: Sequence[DecodeInput]
               ) -> Iterator[None]:
        """Report the enclosed step to ``on_step``: a prefill, decode or mixed step, its
        wall time (on a GPU: until its work is queued, or waited for), its sequences and
        tokens. A step that raises is not reported."""
        started = time.perf_counter()
        yield
        if self.on_step is not None:
            kind = "mixed" if chunks and decodes else "prefill" if chunks else "decode"
            self.on_step(kind, time.perf_counter() - started, len(chunks) + len(decodes),
                         sum(c.end - c.start for c in chunks) + len(decodes))

    def _check_chunks(self, chunks: Sequence[PrefillChunk]) -> None:
        for c in chunks:
            if not 0 <= c.start < c.end <= len(c.token_ids):
                raise EngineInputError(f"chunk [{c.start}, {c.end}) outside a prompt of "
                                       f"{len(c.token_ids)} tokens")
            self._check_block_table(c.block_table, c.end)
            self._check_adapter(c.adapter)

    def _forward(self, chunks: Sequence[PrefillChunk], decodes: Sequence[DecodeInput],
                 layer_hook: Optional[Callable[[int], None]],
                 ) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
        return self._logits(self._hidden(chunks, decodes, layer_hook), chunks, decodes)

    def _hidden(self, chunks: Sequence[PrefillChunk], decodes: Sequence[DecodeInput],
                layer_hook: Optional[Callable[[int], None]],
                hidden_in: Optional[torch.Tensor] = None,
                before_layer: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Hidden states out of this stage's last layer for the step's tokens: the chunks'
        (each attending in ``_pieces``), then one of each decode."""
        ids: list[int] = []
        parts: list[tuple[int, int, AttnMetadata]] = []
        for c in chunks:
            table = torch.tensor(c.block_table[:self.blocks_needed(c.end)], dtype=torch.long,
                                 device=self.device)
            pieces = self._pieces(c.start, c.end)
            for start, end in pieces:
                meta = self.meta.prefill(table, start, end)
                meta.chunk_table = table if len(pieces) > 1 else None  # gathered once
                parts.append((len(ids), len(ids) + end - start, meta))
                ids += c.token_ids[start:end]
        if decodes:
            parts.append((len(ids), len(ids) + len(decodes), self.meta.decode(decodes)))
            ids += [d.token_id for d in decodes]
        meta = parts[0][2] if len(parts) == 1 else mixed(parts)
        lora = LoraRows.of(self.model.adapters, [(c.adapter, c.end - c.start) for c in chunks]
                           + [(d.adapter, 1) for d in decodes], self.device) \
            if self.model.adapters else None
        graphs = self.prompt_graphs
        if graphs is not None and chunks and len(ids) <= graphs.max_tokens and lora is None:
            positions = [p for c in chunks for p in range(c.start, c.end)]
            return graphs.forward(ids, positions + [d.position for d in decodes], meta,
                                  self.attention, layer_hook, before_layer)
        return self.model.forward(torch.tensor(ids, dtype=torch.long, device=self.device),
                                  meta, self.attention, layer_hook, hidden_in, before_layer,
                                  lora)

    def _logits(self, hidden: torch.Tensor, chunks: Sequence[PrefillChunk],
                decodes: Sequence[DecodeInput],
                ) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
        # Logits only where a token is sampled: the last token of finished prompts, and
        # every decode row; one lm_head call for all of them.
        ends = list(itertools.accumulate(c.end - c.start for c in chunks))
        rows = [e - 1 for e, c in zip(ends, chunks) if c.last]
        first_decode = len(rows)
        if decodes:
            start = ends[-1] if ends else 0
            rows += range(start, start + len(decodes))
        logits = self.model.logits(hidden[rows]) if rows else None
        out: list[Optional[torch.Tensor]] = []
        i = 0
        for c in chunks:
            out.append(logits[i] if c.last else None)
            i += c.last
        return out, (logits[first_decode:] if decodes else None)

    def _pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        """A chunk's attention parts: [start, end) cut at multiples of ``chunk_align``
        (whole where the backend computes each prompt row alone anyway)."""
        align = 0 if self.attention.prompt_rows_alone else self.config.chunk_align
        bounds = [start, *range((start // align + 1) * align, end, align), end] if align > 0 \
            else [start, end]
        return list(zip(bounds, bounds[1:]))

    def decode_step(self, batch: list[DecodeInput]) -> torch.Tensor:
        """Feed one token per sequence at its position; logits [B, vocab] (float32). On a
        GPU a captured CUDA graph replays the step (``self.graphs``)."""
        if not batch:
            raise EngineInputError("decode_step needs at least one sequence")
        if (self.graphs is not None and len(batch) <= self.graphs.max_batch
                and all(d.adapter is None for d in batch)):  # graphs hold no adapter
            self._check_decodes(batch)
            with self._timed((), batch):
                return self.graphs.replay(batch)
        logits = self.step(decodes=batch)[1]
        assert logits is not None
        return logits

    def _check_decodes(self, batch: Sequence[DecodeInput]) -> None:
        if len(batch) > self.config.max_batch_size:
            raise EngineInputError(f"batch of {len(batch)} exceeds max_batch_size "
                                   f"{self.config.max_batch_size}")
        for item in batch:
            if not 0 <= item.position < self.max_context:
                raise EngineInputError(f"position {item.position} outside context "
                                       f"[0, {self.max_context})")
            self._check_token_ids([item.token_id])
            self._check_block_table(item.block_table, item.position + 1)
            self._check_adapter(item.adapter)
