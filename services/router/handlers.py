"""HTTP handlers: the OpenAI generation endpoints and the service endpoints."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Coroutine, Optional, Sequence, TypeVar

from dataclasses import asdict, replace

import orjson
from aiohttp import web

from common import timeline
from common.grammar import xgrammar_loaded
from common.protocol import SubmitRequest
from common.sampling_params import SamplingParams
from services.router.errors import ApiError, invalid
from services.router.flow import RequestRun
from services.router.choices import Choices
from services.router.openai_format import DONE, ResponseBuilder, sse, usage
from services.router.state import RouterState
from services.router.structured import may_carry_grammar
from services.router.tokenize import (check_token_ids, encode_chat, parse_detokenize,
                                      parse_tokenize)
from services.router.tokenize import tokenize as tokenize_ids
from services.router.tool_response import TaggedCallsBuilder
from services.router.validation import GenerationRequest, Prompt, parse_request

log = logging.getLogger(__name__)

STATE: web.AppKey[RouterState] = web.AppKey("state", RouterState)
CLIENT_GONE = 499  # nginx's "client closed request", as a metrics label
_LONG_TEXT = 20_000  # characters; longer prompts are tokenized off the event loop
T = TypeVar("T")


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj),
                        content_type="application/json")


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise invalid("the request body is empty", code="invalid_json")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}",
                      code="invalid_json") from None


def _tokenize(state: RouterState, req: GenerationRequest, prompt: Optional[Prompt] = None,
              param: str = "prompt") -> list[int]:
    tok = state.tokenizer
    if req.kind == "chat":
        return encode_chat(tok, req.messages or [], tools=req.tools,
                           template_kwargs=req.template_kwargs)
    if isinstance(prompt, str):
        return tok.encode_text(prompt)
    ids = list(prompt or [])
    check_token_ids(tok, ids, param)
    return ids


async def _off_loop_if_long(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a thread when it tokenizes over ``_LONG_TEXT`` characters."""
    if size > _LONG_TEXT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


async def _prompt(state: RouterState, req: GenerationRequest, prompt: Optional[Prompt],
                  param: str) -> tuple[list[int], SamplingParams]:
    """Token ids of the prompt (``prompt`` of a completion, named ``param`` in errors)
    and the sampling to ask for, its max_tokens fitted to the context; 400 when they do
    not fit."""
    size = sum(len(m["content"]) for m in req.messages or []) if req.kind == "chat" \
        else len(prompt or "")
    ids = await _off_loop_if_long(size, _tokenize, state, req, prompt, param)
    if not ids:
        raise invalid("the prompt is empty", param, "invalid_value")
    ctx = state.tokenizer.context_length
    asked = req.sampling.max_tokens if req.max_tokens_asked else 1
    if len(ids) + asked > ctx:
        raise invalid(f"This model's maximum context length is {ctx} tokens; the prompt has "
                      f"{len(ids)} tokens and {asked} more were requested",
                      param, "context_length_exceeded")
    if req.max_tokens_asked:
        return ids, req.sampling
    return ids, replace(req.sampling, max_tokens=min(req.sampling.max_tokens, ctx - len(ids)))


async def _prompts(state: RouterState, req: GenerationRequest,
                   ) -> list[tuple[list[int], SamplingParams]]:
    """``_prompt`` of each prompt of the request (chat: its messages), after the checks
    that do not depend on the prompt."""
    bad = state.tokenizer.out_of_vocab(req.sampling.logit_bias_ids)
    if bad is not None:
        raise invalid(f"'logit_bias' has token id {bad}, outside the vocabulary (size "
                      f"{state.tokenizer.vocab_size})", "logit_bias", "invalid_value")
    config = state.config
    if req.sampling.prompt_logprobs is not None and (
            config.mode == "colocated" or config.prefill_stages > 1):
        shape = "colocated workers" if config.mode == "colocated" else "pipeline groups"
        raise invalid(f"'echo' with 'logprobs' (the prompt's logprobs) is not supported on "
                      f"this cluster's {shape} yet; echo without logprobs is",
                      "echo", "unsupported_value")
    if req.kind == "chat":
        return [await _prompt(state, req, None, "messages")]
    many = len(req.prompts) > 1
    return [await _prompt(state, req, p, f"prompt[{i}]" if many else "prompt")
            for i, p in enumerate(req.prompts)]


def _choices(state: RouterState, req: GenerationRequest, request_id: str,
             prompt: Optional[Prompt] = None, ids: Sequence[int] = ()) -> Choices:
    """The builders of one prompt's choices; with ``echo`` each starts with the prompt's
    text (a string prompt as sent, token ids decoded) and its tokens."""
    tok = state.tokenizer
    cls = TaggedCallsBuilder if req.tagged_calls else ResponseBuilder
    # a JSON answer (response_format) is held to its grammar from the first token
    json_only = req.sampling.response_format is not None and not req.tagged_calls
    reasoning = None if json_only else state.config.reasoning_parser
    created = int(time.time())
    echo = None
    if req.echo:
        echo = prompt if isinstance(prompt, str) else tok.decode(list(ids))
    return Choices([cls(kind=req.kind, request_id=request_id, model=req.model, created=created,
                        token_text=lambda t: tok.decode([t]),
                        want_logprobs=req.sampling.logprobs,
                        want_top=req.sampling.top_logprobs, include_usage=req.include_usage,
                        tool_call=req.tool_call, index=i, echo=echo,
                        prompt_ids=list(ids) if req.echo else [], reasoning=reasoning)
                    for i in range(req.sampling.n)], req.returned)


def _wire_sampling(req: GenerationRequest, sampling: SamplingParams) -> SamplingParams:
    """What the workers sample under: best_of ranks its choices by cumulative logprob,
    so the workers report every token's (the answer shows them only where asked)."""
    return replace(sampling, logprobs=True) if req.returned < sampling.n else sampling


async def _collect(run: RequestRun, out: Choices) -> None:
    await run.wait_started()
    async for delta in run.deltas():
        out.take(delta)


async def _complete(run: RequestRun, out: Choices) -> web.Response:
    await _collect(run, out)
    return _json(out.response())


async def _stream(request: web.Request, run: RequestRun, out: Choices,
                  ) -> web.StreamResponse:
    """SSE; errors before the first byte are plain HTTP errors, after it error chunks."""
    await run.wait_started()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    run.status = 200
    try:
        await _write_events(resp, run, out)
        await resp.write(DONE)
    except ConnectionResetError:
        log.info("%s: client disconnected", run.request_id)
        run.status = CLIENT_GONE
    return resp


async def _write_events(resp: web.StreamResponse, run: RequestRun, out: Choices) -> None:
    try:
        if out.first.kind == "chat":
            for chunk in out.role_chunks():
                await resp.write(sse(chunk))
        first = True
        async for delta in run.deltas():
            for chunk in out.absorb(delta):
                await resp.write(sse(chunk))
            if first:
                timeline.mark("first_written", run.request_id)
                first = False
        usage = out.usage_chunk()
        if usage is not None:
            await resp.write(sse(usage))
    except ApiError as err:
        run.status = err.status
        await resp.write(sse(err.body()))


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    state = request.app[STATE]
    endpoint = request.path
    request_id = f"cmpl-{uuid.uuid4().hex}"
    req: Optional[GenerationRequest] = None
    try:
        body = await _read_json(request)
        timeline.mark("router_in", request_id)
        if may_carry_grammar(body):
            await xgrammar_loaded()
        req = parse_request(body, kind, state.config.served_names,
                            state.config.default_max_tokens)
        prompts = await _prompts(state, req)
    except ApiError as err:
        state.metrics.requests.labels(endpoint, str(err.status),
                                      "" if req is None else req.model).inc()
        raise
    if len(prompts) > 1:
        return await _complete_batch(state, endpoint, req, request_id, prompts)
    ids, sampling = prompts[0]
    submit = SubmitRequest(request_id, ids, state.block_keys(ids, sampling.adapter),
                           _wire_sampling(req, sampling), time.time())
    run = RequestRun(state, endpoint, submit)
    out = _choices(state, req, request_id, req.prompt, ids)
    run.status = CLIENT_GONE  # unless something below sets the real outcome
    try:
        if req.stream:
            return await _stream(request, run, out)
        resp = await _complete(run, out)
        run.status = 200
        return resp
    except ApiError as err:
        run.status = err.status
        raise
    finally:
        run.finish(run.status, (out.prompt_tokens, out.cached_tokens))


async def _complete_batch(state: RouterState, endpoint: str, req: GenerationRequest,
                          request_id: str, prompts: list[tuple[list[int], SamplingParams]],
                          ) -> web.Response:
    """A list of prompts (completions, not streamed): one cluster request each
    (``<id>-<i>``), run side by side; one response whose choices are prompt i's n at
    indices i × n + j, and whose usage sums them all. A failure of one fails the whole
    (the others are aborted, their blocks freed)."""
    runs: list[tuple[RequestRun, Choices]] = []
    status = CLIENT_GONE
    try:
        for i, ((ids, sampling), prompt) in enumerate(zip(prompts, req.prompts)):
            submit = SubmitRequest(f"{request_id}-{i}", ids,
                                   state.block_keys(ids, sampling.adapter),
                                   _wire_sampling(req, sampling), time.time())
            runs.append((RequestRun(state, endpoint, submit),
                         _choices(state, req, request_id, prompt, ids)))
        await _all([_collect(run, out) for run, out in runs])
        choices = [c for i, (_, out) in enumerate(runs) for c in out.choices(i * req.returned)]
        usages = [out.usage() for _, out in runs]
        status = 200
    except ApiError as err:
        status = err.status
        raise
    finally:
        for run, out in runs:
            run.finish(status, (out.prompt_tokens, out.cached_tokens))
    total = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    return _json(runs[0][1].first.response(
        choices, usage(total["prompt_tokens"], total["completion_tokens"], cached)))


async def _all(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` together; the first to fail cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    req = parse_tokenize(await _read_json(request), state.config.served_names)
    return _json(await _off_loop_if_long(req.size, tokenize_ids, state.tokenizer, req))


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    ids = parse_detokenize(await _read_json(request), state.tokenizer,
                           state.config.served_names)
    text = await _off_loop_if_long(len(ids), state.tokenizer.decode, ids)
    return _json({"prompt": text})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    card = {"id": config.model_name, "object": "model", "created": state.started,
            "owned_by": "crescent", "max_model_len": state.tokenizer.context_length,
            "root": config.model, "parent": None}
    # each LoRA adapter as vLLM lists it: its directory the root, the base model the parent
    adapters = [{**card, "id": name, "root": path, "parent": config.model_name}
                for name, path in config.lora_modules.items()]
    return _json({"object": "list", "data": [card, *adapters]})


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return _json({"status": "unavailable", "reason": "shutting down"}, status=503)
    if state.is_ready():
        return _json({"status": "ok"})
    age = state.status_age()
    reason = ("no status from the conductor yet" if age is None
              else "cluster not ready" if state.status is not None and not state.status.ready
              else f"conductor status is stale ({age:.1f} s old)")
    return _json({"status": "unavailable", "reason": reason}, status=503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    resp = web.Response(body=state.metrics.render())
    resp.headers["Content-Type"] = state.metrics.CONTENT_TYPE
    return resp


async def debug_pools(request: web.Request) -> web.Response:
    state = request.app[STATE]
    status = state.status
    return _json({"ready": bool(status and status.ready), "age_s": state.status_age(),
                  "instances": [asdict(i) for i in status.instances] if status else []})


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/chat/completions", chat_completions),
            web.post("/v1/completions", completions),
            web.post("/tokenize", tokenize),
            web.post("/detokenize", detokenize),
            web.get("/v1/models", models),
            web.get("/health", health),
            web.get("/metrics", metrics),
            web.get("/debug/pools", debug_pools)]
