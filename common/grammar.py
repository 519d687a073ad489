"""Grammar-constrained sampling (``response_format``) with xgrammar.

A request's ``SamplingParams.response_format`` is the canonical JSON text of OpenAI's
``response_format`` object (``json_object`` or ``json_schema``), or of an xgrammar
structural tag (``{"type": "structural_tag", "format": {...}}``: free text with
``<tool_call>`` blocks whose JSON follows the tools' schemas, services/router/
structured.py); the router checked it with ``check_response_format``. Each worker compiles
it once per distinct value against its tokenizer (``Grammars``, an LRU of compiled
grammars) and gives every constrained sequence its own ``GrammarMatcher``. Before a token
is chosen the matcher's token bitmask forbids every token the grammar does not allow next;
the chosen token then advances it.

The first token is sampled on the prefill side (prefill worker, a group's last stage,
colocated worker) under a fresh matcher that is then dropped; the decode worker builds
its own matcher and advances it with that first token, so both sides of the handover see
the same grammar state without shipping it.

Whitespace: schemas compile without free whitespace between JSON tokens (one space after
``:`` and ``,``, as ``json.dumps`` writes), so a small model cannot wander into endless
newlines inside an object. A structural tag's ``json_schema`` contents get the same
grammar (xgrammar's own would allow free whitespace): each is replaced by the EBNF of
``Grammar.from_json_schema`` before the tag is compiled.
"""
from __future__ import annotations

import asyncio
import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

MAX_COMPILED = 64  # distinct response formats a worker keeps compiled


_IMPORT = threading.Lock()
_XGRAMMAR: Optional[ModuleType] = None  # set once imported; a step's calls skip the lock


async def xgrammar_loaded() -> None:
    """Until xgrammar is imported, importing it on a thread the first time (a router's
    first request that may carry a grammar): its loop keeps serving meanwhile, and a
    router that only ever sees free text never spends that CPU."""
    if _XGRAMMAR is None:
        await asyncio.to_thread(_xgr)


def _xgr() -> ModuleType:
    """xgrammar, imported at a process's first grammar: it imports transformers and torch,
    about a second of CPU that a router or worker serving free text never spends. One
    thread imports it (a worker compiles on its own thread while its loop may check or
    match): transformers' lazy module fails names asked for while another thread imports
    it ("cannot import name 'PreTrainedTokenizerBase'")."""
    global _XGRAMMAR
    if _XGRAMMAR is None:
        with _IMPORT:
            import xgrammar
            _XGRAMMAR = xgrammar
    return _XGRAMMAR


def _schema_of(response_format: str) -> tuple[str, bool]:
    """(JSON schema text, strict) for a canonical ``response_format``; ``json_object``
    is any JSON object (not strict: any property may appear)."""
    fmt = json.loads(response_format)
    if fmt.get("type") == "json_object":
        return '{"type": "object"}', False
    spec = fmt["json_schema"]
    return json.dumps(spec.get("schema", {})), True


def _compact(node: Any) -> Any:
    """A structural tag's format tree with every ``json_schema`` node replaced by the
    grammar (EBNF) of its schema as ``response_format`` compiles one: no free whitespace,
    strict."""
    if isinstance(node, list):
        return [_compact(n) for n in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and "json_schema" in node:
        schema = json.dumps(node["json_schema"])
        ebnf = _xgr().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        return {"type": "grammar", "grammar": str(ebnf)}
    return {k: _compact(v) for k, v in node.items()}


def _structural_tag(response_format: str) -> Optional[str]:
    """The structural tag to compile (JSON text), or None for a JSON format."""
    fmt = json.loads(response_format)
    if fmt.get("type") != "structural_tag":
        return None
    return json.dumps({"type": "structural_tag", "format": _compact(fmt["format"])})


@functools.lru_cache(maxsize=256)
def check_response_format(response_format: str) -> None:
    """Raise ValueError if ``response_format``'s schema cannot become a grammar (the
    router's 400). Needs no tokenizer, so the router checks what workers will compile."""
    what = "the JSON schema"
    try:
        tag = _structural_tag(response_format)
        if tag is not None:
            what = "the structural tag (or a JSON schema in it)"
            _xgr().Grammar.from_structural_tag(tag)
            return
        schema, strict = _schema_of(response_format)
        _xgr().Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/InvalidJSONError
        why = re.sub(r"^\[[^\]]*\] \S+: ", "", str(exc)).strip()  # xgrammar's log prefix
        raise ValueError(f"{what} cannot be compiled to a grammar: {why}") from exc


def tokenizer_info(tokenizer: Any, vocab_size: int,
                   stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of Crescent's tokenizer (common/model/tokenizer.py): a HF fast
    tokenizer through transformers, or the byte tokenizer's raw bytes."""
    xgr = _xgr()  # transformers with it, whole
    if hasattr(tokenizer, "_tk"):
        from transformers import PreTrainedTokenizerFast
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer._tk)
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    off = tokenizer.OFFSET
    vocab = [b""] * off + [bytes([b]) for b in range(256)]
    vocab += [b""] * (vocab_size - len(vocab))
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=list(stop_token_ids))


class GrammarError(ValueError):
    """A response format this worker cannot compile. The router compiled the same schema
    already, so this is rare (a tokenizer-specific failure); the request fails with a 400
    and frees its blocks, nothing else is affected."""


class Grammars:
    """One worker's compiled grammars (an LRU, compiled once per response format) and
    the bitmasks of a step. Compiling (~0.5 s for smollm2's vocabulary) runs on a thread
    of its own: a worker ``prefetch``es a request's grammar when the request arrives, so
    its event loop (every other stream's steps) rarely waits for one. ``info`` makes the
    tokenizer info, on first use: workers that never see a ``response_format`` never
    pay for it."""

    def __init__(self, info: Callable[[], xgr.TokenizerInfo],
                 max_compiled: int = MAX_COMPILED) -> None:
        self._info = info
        self._compiler: Optional[xgr.GrammarCompiler] = None  # made on the thread
        self._vocab = 0  # the tokenizer info's vocabulary size, once it is made
        self._compiled: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._max = max_compiled
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compiles = 0  # how many times a grammar was compiled (tests, metrics)

    @classmethod
    def for_engine(cls, engine: Any) -> Grammars:
        """The grammars of a worker's engine: its tokenizer, vocabulary and EOS tokens."""
        mc = engine.model_config
        return cls(lambda: tokenizer_info(engine.tokenizer, mc.vocab_size, mc.eos_token_ids))

    def prefetch(self, params: SamplingParams) -> None:
        """Start compiling a request's grammar, if it has one and it is not cached."""
        if params.response_format is not None:
            self._future(params.response_format)

    def is_ready(self, params: SamplingParams) -> bool:
        """A free request, or one whose grammar has compiled (or failed to)."""
        return params.response_format is None or self._future(params.response_format).done()

    async def ready(self, params: SamplingParams) -> None:
        """Until a request's grammar is compiled (or failed: ``compiled`` says so), its
        event loop free meanwhile: a worker that did not ``prefetch`` it (a pipeline's
        last stage learns of it with the step) must not stop its heartbeats for a compile
        (seconds for the first one on a loaded host)."""
        if params.response_format is not None:
            await asyncio.wait([asyncio.wrap_future(self._future(params.response_format))])

    def compiled(self, response_format: str) -> xgr.CompiledGrammar:
        """The grammar of ``response_format`` (waits for its compile if it is running);
        GrammarError if it cannot be compiled (the failure stays cached)."""
        try:
            return self._future(response_format).result()
        except Exception as exc:
            raise GrammarError(f"'response_format' cannot be compiled on this worker: "
                               f"{exc}") from exc

    def _future(self, response_format: str) -> Future[xgr.CompiledGrammar]:
        hit = self._compiled.get(response_format)
        if hit is not None:
            self._compiled.move_to_end(response_format)
            return hit
        future = self._thread.submit(self._compile, response_format)
        self._compiled[response_format] = future
        if len(self._compiled) > self._max:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, response_format: str) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = self._info()
            self._compiler = _xgr().GrammarCompiler(info, cache_enabled=False)
            self._vocab = info.vocab_size
        self.compiles += 1
        tag = _structural_tag(response_format)
        if tag is not None:
            return self._compiler.compile_structural_tag(tag)
        schema, strict = _schema_of(response_format)
        return self._compiler.compile_json_schema(schema, any_whitespace=False,
                                                  strict_mode=strict)

    def matcher(self, params: SamplingParams) -> Optional[xgr.GrammarMatcher]:
        """A matcher for a constrained request, None for a free one: fresh, or past a
        continuation's resumed tokens (which it accepted before)."""
        if params.response_format is None:
            return None
        matcher = _xgr().GrammarMatcher(self.compiled(params.response_format))
        for token in params.resumed:
            if not matcher.accept_token(token):
                raise GrammarError(f"resumed token {token} breaks the response format")
        return matcher

    def bitmask(self, matchers: Sequence[Optional[xgr.GrammarMatcher]]
                ) -> Optional[torch.Tensor]:
        """The step's token bitmask [B, ceil(V/32)] (int32; a set bit allows the token;
        rows without a matcher allow everything), or None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        mask = _xgr().allocate_token_bitmask(len(matchers), self._vocab)
        for i in rows:
            matchers[i].fill_next_token_bitmask(mask, i)
        return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` [B, V] with the tokens ``bitmask`` forbids set to -inf."""
    masked = logits.clone()
    _xgr().apply_token_bitmask_inplace(masked, bitmask.to(masked.device))
    return masked
