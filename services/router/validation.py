"""Validate OpenAI request bodies into a small typed request; every failure is a 400.

Which fields are honoured and which refused is request_fields.py's table; this module
parses the honoured ones (messages: chat_messages.py). The sampling knobs become the one
``SamplingParams`` (common/sampling_params.py) that the wire carries to the workers; the
handler only fits ``max_tokens`` to the prompt.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence, Union

from common.sampling_params import (MAX_BIAS, MAX_CHOICES, MAX_PENALTY, MAX_TOP_LOGPROBS,
                                   SamplingParams)
from services.router.chat_messages import parse_messages, parse_template_kwargs
from services.router.errors import ApiError, invalid
from services.router.request_fields import boolean, check_fields, only
from services.router.structured import response_format, tool_plan

MAX_STOP = 4
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024  # token ids in one logit_bias
MAX_PROMPTS = 256  # prompts in one completions request (a list of them)

Prompt = Union[str, list[int]]


@dataclass
class GenerationRequest:
    """One validated request: either chat ``messages`` or a completion ``prompt``."""

    kind: str  # "chat" | "completion"
    model: str
    sampling: SamplingParams  # max_tokens: as asked, else the server default
    max_tokens_asked: bool = False  # asked: a prompt it does not fit is a 400; else clamped
    stream: bool = False
    include_usage: bool = False
    messages: Optional[list[dict[str, str]]] = None
    prompt: Optional[Prompt] = None  # the first (or only) of ``prompts``
    prompts: list[Prompt] = field(default_factory=list)  # completions: one request each
    echo: bool = False  # completions: the prompt before the completion (and its logprobs)
    tool_call: Optional[str] = None  # the function a named tool_choice calls
    returned: int = 1  # choices returned (OpenAI's n); ``sampling.n`` sequences are
    # sampled: more with best_of, the best ``returned`` of them answer
    tagged_calls: bool = False  # tool_choice auto/required: <tool_call> blocks to split
    tools: Optional[list[dict]] = None  # the functions the prompt shows the model
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float,
            lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise invalid(f"'{name}' must be a number", name, "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise invalid(f"'{name}' must be in {bound}, got {value}", name, "invalid_value")
    return float(value)


def _max_tokens(body: dict, echo: bool) -> Optional[int]:
    """The tokens asked for; 0 only with ``echo`` (the prompt alone, as vLLM allows:
    lm-evaluation-harness scores a prompt by its echoed logprobs)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 0 or (value == 0 and not echo):
        raise invalid(f"'{name}' must be an integer >= 1 (0 only with 'echo': true), got "
                      f"{value!r}", name, "invalid_value")
    return value


def _top_k(body: dict) -> Optional[int]:
    value = body.get("top_k")
    if value is None or value == -1:
        return None  # no top-k
    if not _is_int(value) or value < 1:
        raise invalid(f"'top_k' must be -1 or an integer >= 1, got {value!r}", "top_k",
                      "invalid_value")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop",
                      "invalid_type")
    if len(value) > MAX_STOP:
        raise invalid(f"'stop' takes at most {MAX_STOP} strings", "stop", "invalid_value")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{name}' must be a boolean", name, "invalid_type")
    return value


def _seed(body: dict) -> Optional[int]:
    value = body.get("seed")
    if value is not None and not _is_int(value):
        raise invalid("'seed' must be an integer", "seed", "invalid_type")
    if value is not None and not -(1 << 63) <= value < 1 << 63:
        raise invalid("'seed' must fit in 64 bits (signed)", "seed", "invalid_value")
    return value


def _logprobs(body: dict, kind: str) -> tuple[bool, int]:
    """(the sampled tokens' logprobs?, how many top alternatives with them): chat's
    ``logprobs`` + ``top_logprobs`` (0-20), or the completions API's ``logprobs: k``
    (0-5: the sampled token's logprob and the k most likely ones)."""
    value = body.get("logprobs")
    if kind == "chat":
        wanted = _bool(body, "logprobs")
        top = body.get("top_logprobs")
        if top is None:
            return wanted, 0
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise invalid(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                          "top_logprobs", "invalid_value")
        if top and not wanted:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs",
                          "invalid_value")
        return wanted, top
    if value is None or isinstance(value, bool):
        return _bool(body, "logprobs"), 0
    if not _is_int(value) or not 0 <= value <= 5:  # legacy completions: top-N count
        raise invalid("'logprobs' must be an integer in [0, 5]", "logprobs",
                      "invalid_value")
    return True, value


def _penalty(body: dict, name: str) -> float:
    return _number(body, name, 0.0, -MAX_PENALTY, MAX_PENALTY)


def _logit_bias(body: dict) -> tuple[list[int], list[float]]:
    """OpenAI's ``logit_bias``: token id (a JSON key, so a string of digits) → a number in
    [-100, 100] added to its logit; at most ``MAX_LOGIT_BIAS`` ids. The ids are checked
    against the vocabulary once the tokenizer is at hand (handlers.py)."""
    value = body.get("logit_bias")
    if value is None:
        return [], []
    ok = isinstance(value, dict) and len(value) <= MAX_LOGIT_BIAS and all(
        isinstance(k, str) and k.isdigit() and k.isascii() and _is_number(v)
        and -MAX_BIAS <= v <= MAX_BIAS for k, v in value.items())
    if not ok:
        raise invalid(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids (as "
                      f"strings) to numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}]", "logit_bias",
                      "invalid_value")
    return [int(k) for k in value], [float(v) for v in value.values()]


def _stop_token_ids(body: dict) -> list[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS or \
            not all(_is_int(t) and t >= 0 for t in value):
        raise invalid(f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                      "token ids >= 0", "stop_token_ids", "invalid_value")
    return value


def parse_sampling(body: dict, kind: str, max_tokens: int, grammar: Optional[str] = None,
                   sampled: int = 1, echo: bool = False) -> SamplingParams:
    """The body's sampling knobs (``max_tokens`` as decided by the caller; ``grammar``:
    the structured output's, structured.py; ``sampled``: the sequences, ``_choices``;
    ``echo`` with logprobs: the prompt's own too, with as many alternatives)."""
    logprobs, top_logprobs = _logprobs(body, kind)
    bias_ids, bias_values = _logit_bias(body)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_top_k(body), seed=_seed(body), stop=_stop(body),
        stop_token_ids=_stop_token_ids(body), logprobs=logprobs,
        top_logprobs=top_logprobs, ignore_eos=_bool(body, "ignore_eos"),
        response_format=grammar, n=sampled,
        presence_penalty=_penalty(body, "presence_penalty"),
        frequency_penalty=_penalty(body, "frequency_penalty"),
        logit_bias_ids=bias_ids, logit_bias_values=bias_values,
        prompt_logprobs=top_logprobs if echo and logprobs else None)


def _choices(body: dict, kind: str) -> tuple[int, int]:
    """(``n``: the choices returned, the sequences sampled: ``best_of``, completions
    only, else ``n``)."""
    n = 1 if body.get("n") is None else body["n"]
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise invalid(f"'n' must be an integer in [1, {MAX_CHOICES}]", "n", "invalid_value")
    best_of = body.get("best_of") if kind == "completion" else None
    if best_of is None:
        return n, n
    if not _is_int(best_of) or not n <= best_of <= MAX_CHOICES:
        raise invalid(f"'best_of' must be an integer in [n, {MAX_CHOICES}] (n = {n})",
                      "best_of", "invalid_value")
    if best_of > n and body.get("stream"):
        raise invalid("'best_of' greater than 'n' cannot be streamed: the best choices "
                      "are known only at the end", "best_of", "invalid_value")
    return n, best_of


def check_model(body: dict, served: Sequence[str]) -> str:
    """The ``model`` asked for: one of ``served`` (the base model's name first, then its
    LoRA adapters'); left out, the base model."""
    model = body.get("model")
    if model is None:
        return served[0]
    if model not in served:
        names = ", ".join(f"'{name}'" for name in served)
        raise invalid(f"The model '{model}' does not exist; this server serves {names}",
                      "model", "model_not_found")
    return model


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid("'stream_options' must be an object", "stream_options",
                      "invalid_type")
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true",
                      "stream_options", "invalid_value")
    include_usage = False
    for key, value in options.items():
        param = f"stream_options.{key}"
        if value is None:
            continue
        if key == "include_usage":
            boolean(param, value)
            include_usage = value
        elif key == "include_obfuscation":
            only(False, why="is not supported: Crescent adds no obfuscation")(param, value)
        else:
            raise invalid(f"unknown parameter '{param}'", param, "unknown_parameter")
    return stream, include_usage


def _one_prompt(value: Any, param: str) -> Optional[Prompt]:
    """A string or a list of token ids (400 when empty); None for anything else."""
    if isinstance(value, str) or (isinstance(value, list) and
                                  all(type(t) is int for t in value)):  # a bool is no id
        if not value:
            raise invalid(f"'{param}' must not be empty", param, "invalid_value")
        return value
    return None


def parse_prompts(value: Any) -> list[Prompt]:
    """OpenAI's ``prompt``: a string, a list of token ids, or a list of either (a batch:
    one request each, their choices in order)."""
    one = _one_prompt(value, "prompt")
    if one is not None:
        return [one]
    if isinstance(value, list) and all(isinstance(p, (str, list)) for p in value):
        if len(value) > MAX_PROMPTS:
            raise invalid(f"'prompt' takes at most {MAX_PROMPTS} prompts", "prompt",
                          "invalid_value")
        prompts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
        if all(p is not None for p in prompts):
            return prompts  # type: ignore[return-value]
    raise invalid("'prompt' must be a string, a list of token ids, or a list of strings or "
                  "of token id lists", "prompt", "invalid_type")


def _check_echo(req: GenerationRequest) -> None:
    """What ``echo`` and a batch of prompts do not stream (yet): 400s naming the field."""
    if req.stream and req.echo:
        raise invalid("'echo': true cannot be combined with 'stream': true (not "
                      "supported yet)", "echo", "unsupported_value")
    if req.stream and len(req.prompts) > 1:
        raise invalid("a list of several prompts cannot be combined with 'stream': true "
                      "(not supported yet): send one request per prompt", "prompt",
                      "unsupported_value")


def parse_request(body: Any, kind: str, served: Sequence[str],
                  default_max_tokens: int) -> GenerationRequest:
    """Validate a chat (``kind="chat"``) or completion body; raise ``ApiError`` (400).
    ``served``: the model names (``check_model``); a LoRA adapter's runs on it."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = check_model(body, served)
    check_fields(body, kind)
    stream, include_usage = _stream_flags(body)
    echo = kind == "completion" and _bool(body, "echo")
    asked = _max_tokens(body, echo)
    plan = tool_plan(body) if kind == "chat" else None
    grammar = plan.grammar if plan is not None and plan.grammar is not None else \
        response_format(body) if kind == "chat" else None
    n, sampled = _choices(body, kind)
    sampling = parse_sampling(body, kind, default_max_tokens if asked is None else asked,
                              grammar, sampled, echo)
    if model != served[0]:
        sampling = replace(sampling, adapter=model)
    req = GenerationRequest(kind=kind, model=model, sampling=sampling,
                            max_tokens_asked=asked is not None, stream=stream,
                            include_usage=include_usage, returned=n, echo=echo)
    if plan is not None and plan.functions:
        req.tool_call, req.tagged_calls = plan.named, plan.tagged
        req.tools = list(plan.functions)
    if kind == "chat":
        if "messages" not in body:
            raise invalid("'messages' is required", "messages", "missing_required_parameter")
        req.messages = parse_messages(body["messages"])
        req.template_kwargs = parse_template_kwargs(body.get("chat_template_kwargs"))
    else:
        if "prompt" not in body:
            raise invalid("'prompt' is required", "prompt", "missing_required_parameter")
        req.prompts = parse_prompts(body["prompt"])
        req.prompt = req.prompts[0]
        _check_echo(req)
    return req


__all__ = ["ApiError", "GenerationRequest", "check_model", "parse_request"]
