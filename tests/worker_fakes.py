"""In-memory stand-ins for what a worker runs on (``common/worker.py:WorkerRuntime``), to
unit-test the workers' policy: admission, batching, aborts, deadlines, block accounting.

The block pool and the paged KV memory are the real ones (small); the engine computes
nothing and answers scripted tokens; the transfer agent and the mailbox record what they
are asked to do. One ``trace`` list orders the transfer's writes and the mailbox's sends.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator, Optional, Sequence, TypeVar

import torch

from common.config import ClusterConfig
from common.engine.config import DecodeInput, EngineConfig, PrefillChunk
from common.engine.errors import EngineInputError
from common.engine.profiling import StepProfiler
from common.grammar import GrammarError
from common.idle_check import IdleCheck
from common.kv.block_keys import compute_block_keys
from common.kv.block_pool import BlockPool
from common.kv.memory import PagedKVMemory
from common.protocol import BlocksReserved, Fence, PrefillTask, ReserveBlocks, TokenDeltas
from common.sampling_params import SamplingParams
from common.transfer import TransferError
from services.prefill.prefix import PrefixLoader

M = TypeVar("M")
W = TypeVar("W")
VOCAB = 64
EOS = 0
DECODE_INBOX = "tcp://decode-0"
ROUTER_INBOX = "tcp://router"
CONDUCTOR = "tcp://conductor"
EPOCH = 7  # every fake worker's incarnation
FAKE_BLOCK = 4  # tokens per KV block of every fake engine
FAKE_FINGERPRINT = b"fake-model"  # its block keys' model fingerprint


@dataclass
class ModelConfig:
    max_position_embeddings: int = 256
    eos_token_ids: tuple[int, ...] = (EOS,)
    num_layers: int = 2


class FakeEngine:
    """The engine surface the workers call. A token's successor is ``next_token(token)``
    (default: token + 1, wrapping past EOS). ``gate``: a step waits for it; ``fail``: the
    next step raises it; ``interrupt``: something happens while the next step runs."""

    def __init__(self, num_blocks: int = 16, block_size: int = FAKE_BLOCK,
                 max_batch_size: int = 8, trace: Optional[list] = None) -> None:
        self.config = EngineConfig(model="fake", num_blocks=num_blocks, block_size=block_size,
                                   max_batch_size=max_batch_size)
        self.model_config = ModelConfig()
        self.layers = range(self.model_config.num_layers)
        self.pool = BlockPool(num_blocks)
        self.kv = PagedKVMemory(num_blocks, self.model_config.num_layers, block_size,
                                num_kv_heads=1, head_dim=2)
        self.next_token: Callable[[int], int] = lambda t: t + 1 if t + 1 < VOCAB else 1
        self.steps: list[tuple[list[PrefillChunk], list[DecodeInput]]] = []
        self.gate: Optional[threading.Event] = None
        self.fail: Optional[Exception] = None
        self._mid_step: Optional[Callable[[], None]] = None
        self.trace = trace if trace is not None else []
        self.profiler = StepProfiler(None, "fake", 0)

    def interrupt(self, loop: asyncio.AbstractEventLoop, action: Callable[[], None]) -> None:
        """The next step, once under way, waits for ``action`` to run on the worker's
        event loop (an abort arriving mid-step)."""
        def hook() -> None:
            ran = threading.Event()
            loop.call_soon_threadsafe(lambda: (action(), ran.set()))
            if not ran.wait(10):
                raise RuntimeError("the interrupting action never ran")
        self._mid_step = hook

    def validate_prompt(self, tokens: Sequence[int]) -> None:
        limit = min(self.model_config.max_position_embeddings,
                    self.config.num_blocks * self.config.block_size)
        if not tokens or len(tokens) > limit:
            raise EngineInputError(f"prompt of {len(tokens)} tokens; 1 to {limit} fit")

    def decode_tokens(self, ids: Sequence[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def _logits(self, tokens: Sequence[int]) -> torch.Tensor:
        return one_hot([self.next_token(t) for t in tokens])

    def compute_layer(self, chunks: Sequence[PrefillChunk], layer: int) -> None:
        """What one layer of a step leaves in the KV memory: nothing here."""

    def decode_logits(self, decodes: Sequence[DecodeInput]) -> torch.Tensor:
        return self._logits([d.token_id for d in decodes])

    def stage_step(self, chunks: Sequence[PrefillChunk], hidden: Optional[torch.Tensor] = None,
                   layer_hook: Optional[Callable[[int], None]] = None,
                   before_layer: Optional[Callable[[int], None]] = None,
                   ) -> tuple[torch.Tensor, list[Optional[torch.Tensor]]]:
        """A prefill worker's step (a whole model is its only stage)."""
        rows, _ = self.step(chunks, (), layer_hook, before_layer)
        return torch.zeros(sum(c.end - c.start for c in chunks), 1), rows

    def step(self, chunks: Sequence[PrefillChunk] = (), decodes: Sequence[DecodeInput] = (),
             layer_hook: Optional[Callable[[int], None]] = None,
             before_layer: Optional[Callable[[int], None]] = None,
             ) -> tuple[list[Optional[torch.Tensor]], Optional[torch.Tensor]]:
        self.steps.append((list(chunks), list(decodes)))
        if self.gate is not None and not self.gate.wait(10):
            raise RuntimeError("test gate never opened")
        if self._mid_step is not None:
            hook, self._mid_step = self._mid_step, None
            hook()
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        bs = self.config.block_size
        for c in chunks:
            if not 0 <= c.start < c.end <= len(c.token_ids) or len(c.block_table) * bs < c.end:
                raise EngineInputError(f"bad chunk [{c.start}, {c.end})")
        for layer in range(self.model_config.num_layers):
            if before_layer is not None:
                before_layer(layer)
            self.compute_layer(chunks, layer)
            if layer_hook is not None:
                layer_hook(layer)
        rows = [self._logits([c.token_ids[-1]])[0] if c.end == len(c.token_ids) else None
                for c in chunks]
        return rows, (self.decode_logits(decodes) if decodes else None)

    def decode_step(self, batch: list[DecodeInput]) -> torch.Tensor:
        return self.step((), batch)[1]


def one_hot(tokens: Sequence[int]) -> torch.Tensor:
    """Logits that make greedy sampling pick ``tokens``."""
    out = torch.full((len(tokens), VOCAB), -1e4)
    out[range(len(tokens)), list(tokens)] = 0.0
    return out


class FakeTransfer:
    """Records writes by the remote block offsets they target. ``fail``: writes raise
    TransferError with it; ``hold_s``: each write takes that long (a slow link);
    ``stall[target]``: writes to that target wait for the event (a hung peer), and
    ``started`` is set when one does; ``hung``: native calls still running after their
    caller gave up (what ``in_flight`` reports)."""

    session_id = "fake-prefill:1"

    def __init__(self, trace: list) -> None:
        self.trace = trace
        self.writes: list[tuple[str, int]] = []  # (session, bytes)
        self.fail: Optional[str] = None
        self.hold_s = 0.0
        self.stall: dict[str, threading.Event] = {}
        self.started = threading.Event()
        self.hung: list[Future] = []  # native calls that outlived their caller's deadline

    def in_flight(self, target: Optional[str] = None) -> list[Future]:
        return [f for f in self.hung if not f.done()]

    def write(self, target: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int]) -> int:
        if self.hold_s:
            time.sleep(self.hold_s)
        if target in self.stall:
            self.started.set()
            if not self.stall[target].wait(10):
                raise RuntimeError("test stall never released")
        self.trace.append(("write", target, sum(lengths)))
        if self.fail is not None:
            raise TransferError(self.fail)
        self.writes.append((target, sum(lengths)))
        return sum(lengths)


class FakeMail:
    def __init__(self, trace: list) -> None:
        self.trace = trace
        self.sent: list[tuple[str, Any]] = []

    def send(self, address: str, msg: Any) -> None:
        self.sent.append((address, msg))
        self.trace.append(("send", address, msg))

    def of(self, kind: type[M], to: Optional[str] = None) -> list[M]:
        """What was sent of ``kind`` (to ``to``), in order; a step's ``TokenDeltas``
        counts as its deltas."""
        sent = [(a, d) for a, m in self.sent
                for d in (m.deltas if isinstance(m, TokenDeltas) and kind is not TokenDeltas
                          else [m])]
        return [m for a, m in sent if isinstance(m, kind) and to in (None, a)]

    def kinds(self) -> list[tuple[str, str]]:
        """(recipient, message type) of everything sent, in order."""
        return [(a, type(m).__name__) for a, m in self.sent]


@dataclass
class FakeRuntime:
    """What workers read of a ``WorkerRuntime``."""

    role: str
    engine: FakeEngine
    config: ClusterConfig = field(default_factory=ClusterConfig)
    trace: list = field(default_factory=list)
    instance_id: str = "worker-0"
    conductor: str = CONDUCTOR
    inbox_address: str = "tcp://127.0.0.1:1"
    epoch: int = EPOCH
    handlers: dict = field(default_factory=dict)  # WorkerRuntime's own (ReRegister)
    dropped: Counter = field(default_factory=Counter)  # WorkerRuntime.dropped

    def __post_init__(self) -> None:
        self.engine.trace = self.trace
        self.mail = FakeMail(self.trace)
        self.transfer = FakeTransfer(self.trace)


class Workers:
    """Builds workers on fakes (the store off, the idle check strict and unthrottled) and
    shuts their threads down afterwards."""

    def __init__(self) -> None:
        self.made: list[Any] = []

    def build(self, cls: Callable[..., W], role: str, num_blocks: int = 16, budget: int = 16,
              max_batch_size: int = 8, batch_invariant: bool = False,
              **config: Any) -> tuple[FakeRuntime, W]:
        """``batch_invariant``: chunks end at the config's block boundaries (off by default
        here: most cases pin where unaligned chunks end); ``config``: other settings."""
        engine = FakeEngine(num_blocks, max_batch_size=max_batch_size)
        rt = FakeRuntime(role, engine, ClusterConfig(token_budget=budget,
                                                     batch_invariant=batch_invariant, **config))
        prefix = PrefixLoader(engine.pool, engine.kv, None)
        worker: Any = cls(rt) if role == "decode" else cls(rt, prefix)
        worker.idle_check = IdleCheck(engine.pool.check_idle, "KV block pool", interval_s=0,
                                      strict=True)
        self.made.append(worker)
        return rt, worker

    def close(self) -> None:
        for worker in self.made:
            if hasattr(worker, "threads"):  # a prefill worker's
                worker.threads.close()
            else:
                worker.compute.shutdown()


def workers_of(cls: Callable[..., W], role: str
               ) -> Iterator[Callable[..., tuple[FakeRuntime, W]]]:
    """The body of a test module's ``make`` fixture (``yield from``): builds workers of
    ``cls`` (keywords as ``Workers.build``) and shuts them down afterwards."""
    workers = Workers()
    try:
        yield lambda **kw: workers.build(cls, role, **kw)
    finally:
        workers.close()


def clean(worker: Any) -> None:
    """Idle, and the pool says so: every block free, invariants hold."""
    assert worker.idle()
    assert worker.idle_check.run()


def sampling(max_tokens: int = 4, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def fake_keys(tokens: Sequence[int]) -> list[str]:
    """The router's block keys of ``tokens`` for a fake engine's blocks."""
    return [k.hex() for k in compute_block_keys(tokens, FAKE_BLOCK, FAKE_FINGERPRINT)]


def prefill_task(rid: str, tokens: list[int], decode_blocks: Optional[list[int]] = None,
                 deadline_s: float = 30.0, max_tokens: int = 4,
                 fence: Optional[Fence] = None, epoch: int = EPOCH,
                 decode_id: str = "decode-0") -> PrefillTask:
    """A task whose decode side reserved ``decode_blocks`` (default: enough for the
    prompt, ids 100, 101, ...) under ``fence`` (default: ``fence_for(rid)``), for the
    worker incarnation ``epoch``."""
    if decode_blocks is None:
        decode_blocks = list(range(100, 100 + len(tokens) // 4 + 1))
    return PrefillTask(request_id=rid, token_ids=tokens, block_keys=fake_keys(tokens),
                       sampling=sampling(max_tokens),
                       decode_id=decode_id, decode_inbox=DECODE_INBOX,
                       decode_session=f"fake-{decode_id}:1", decode_kv_base=1 << 20,
                       decode_block_ids=decode_blocks, deadline=time.time() + deadline_s,
                       fence=fence or fence_for(rid), prefill_epoch=epoch)


def fence_for(rid: str) -> Fence:
    """A distinct fence per (short) request id, as if each had its own reservation."""
    return Fence(EPOCH, int.from_bytes(rid.encode()[:7], "big"))


def reserve(rid: str, prompt_tokens: int, deadline_s: float = 30.0, epoch: int = EPOCH,
            writer: Optional[str] = "prefill-0", writer_epoch: int = 1,
            writer_inbox: Optional[str] = None, **sampling_kw: Any) -> ReserveBlocks:
    return ReserveBlocks(request_id=rid, prompt_tokens=prompt_tokens,
                         sampling=sampling(**sampling_kw), router_inbox=ROUTER_INBOX,
                         deadline=time.time() + deadline_s, epoch=epoch, writer=writer,
                         writer_epoch=writer_epoch, writer_inbox=writer_inbox)


def fence_of(rt: FakeRuntime, rid: str) -> Fence:
    """The fence of the latest reservation a worker made for ``rid``."""
    return [m.fence for m in rt.mail.of(BlocksReserved) if m.request_id == rid][-1]


async def run_until(loop: Awaitable[None], done: Callable[[], bool], timeout_s: float = 5.0
                    ) -> None:
    """Run a worker's loop until ``done()``; a loop that dies raises here."""
    task = asyncio.ensure_future(loop)
    try:
        deadline = time.monotonic() + timeout_s
        while not done():
            if task.done():
                task.result()
                raise AssertionError("the loop ended before the condition held")
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout_s}s")
            await asyncio.sleep(0.005)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class BrokenGrammars:
    """A worker's grammars (common/grammar.py) that cannot compile any schema:
    what a worker does when the router accepted one it cannot."""

    def prefetch(self, params: SamplingParams) -> None:
        pass

    def is_ready(self, params: SamplingParams) -> bool:
        return True  # failed already

    def matcher(self, params: SamplingParams) -> None:
        if params.response_format is not None:
            raise GrammarError("'response_format' cannot be compiled here: boom")

    def bitmask(self, matchers: object) -> None:
        return None
