"""Grammar-constrained sampling (common/grammar.py) with smollm2's real tokenizer:
one compile per response format, masks that change the choice, and whole JSON documents
sampled from random logits under the mask that parse and validate."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from common.grammar import GrammarError, Grammars, check_response_format, tokenizer_info
from common.engine.sampling import sample, sample_first
from common.model.loader import load_model_source
from common.model.tokenizer import ByteTokenizer, Tokenizer
from common.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"},
                                           "tags": {"type": "array", "maxItems": 3,
                                                    "items": {"enum": ["a", "b"]}}},
          "required": ["name", "age", "tags"]}
OBJECT = '{"type":"json_object"}'


def _format(schema: dict) -> str:
    return json.dumps({"type": "json_schema", "json_schema": {"schema": schema}},
                      separators=(",", ":"))


@pytest.fixture(scope="module")
def model() -> tuple[Tokenizer, int, tuple[int, ...]]:
    config, _, spec = load_model_source("smollm2-135m", 1)
    return Tokenizer(spec), config.vocab_size, tuple(config.eos_token_ids)


@pytest.fixture
def grammars(model: tuple[Tokenizer, int, tuple[int, ...]]) -> Grammars:
    tok, vocab, eos = model
    return Grammars(lambda: tokenizer_info(tok, vocab, eos), max_compiled=2)


def test_compiled_once_per_schema_and_evicted_least_recent(grammars: Grammars) -> None:
    a, b, c = _format(SCHEMA), OBJECT, _format({"type": "array"})
    assert grammars.compiled(a) is grammars.compiled(a) and grammars.compiles == 1
    for _ in range(5):
        grammars.matcher(SamplingParams(4, response_format=a))
    assert grammars.compiles == 1
    grammars.compiled(b)
    grammars.compiled(a)  # a is now the most recent: c evicts b
    grammars.compiled(c)
    assert grammars.compiles == 3
    grammars.compiled(a)
    assert grammars.compiles == 3
    grammars.compiled(b)
    assert grammars.compiles == 4
    assert grammars.matcher(SamplingParams(4)) is None
    grammars.prefetch(SamplingParams(4, response_format=c))  # compiles on its thread
    grammars.prefetch(SamplingParams(4))  # nothing to compile
    assert grammars.matcher(SamplingParams(4, response_format=c)) is not None
    assert grammars.compiles == 5


def test_ready_waits_for_a_compile_with_the_event_loop_free(grammars: Grammars) -> None:
    """``ready``: the loop keeps running while the grammar compiles (a pipeline stage's
    heartbeats); afterwards it is compiled, once; a free request and a schema that does
    not compile return at once (``compiled`` raises for the latter)."""
    import asyncio

    async def go() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        await grammars.ready(SamplingParams(4, response_format=_format(SCHEMA)))
        await grammars.ready(SamplingParams(4))
        bad = _format({"type": "object", "properties": {"a": {"type": "nope"}}})
        await grammars.ready(SamplingParams(4, response_format=bad))
        task.cancel()
        return ticks

    assert asyncio.run(go()) > 2
    assert grammars.compiles == 2
    grammars.compiled(_format(SCHEMA))
    assert grammars.compiles == 2


def test_a_mask_that_forbids_the_argmax_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0]])
    greedy = SamplingParams(1, temperature=0, logprobs=True, top_logprobs=2)
    forbid_1 = torch.tensor([[0b11101]], dtype=torch.int32)  # bit i allows token i
    free, masked = sample(logits, [greedy], [None]), sample(logits, [greedy], [None],
                                                             forbid_1)
    assert (free.tokens, masked.tokens) == ([1], [3])
    raw = torch.log_softmax(logits[0], -1)  # logprobs stay the model's: raw, unmasked
    assert masked.logprobs == [float(raw[3])] and masked.top[0].token_ids == [1, 3]


def test_grammar_forces_json_where_the_model_prefers_prose(
        grammars: Grammars, model: tuple[Tokenizer, int, tuple[int, ...]]) -> None:
    tok, vocab, _ = model
    logits = torch.zeros(vocab)
    logits[tok.encode("Hello")[0]] = 10.0
    greedy = SamplingParams(8, temperature=0)
    [first] = sample_first(logits, greedy, grammars)
    assert tok.decode([first.token]) == "Hello"
    [first] = sample_first(logits, SamplingParams(8, temperature=0, response_format=OBJECT),
                           grammars)
    assert tok.decode([first.token]).startswith("{")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_logits_under_the_mask_give_valid_documents(
        grammars: Grammars, model: tuple[Tokenizer, int, tuple[int, ...]],
        seed: int) -> None:
    """A batch of one constrained row and one free row, sampled at temperature 1 from
    random logits until the grammar terminates: the text validates against the schema."""
    tok, vocab, eos = model
    gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(400, temperature=1.0, response_format=_format(SCHEMA)),
              SamplingParams(400, temperature=1.0)]
    matchers = [grammars.matcher(params[0]), None]
    out: list[int] = []
    while not matchers[0].is_terminated():
        logits = torch.randn(2, vocab, generator=gen) * 3
        [(token, _, _), _] = sample(logits, params, [gen, gen], grammars.bitmask(matchers))
        assert matchers[0].accept_token(token) and len(out) < 400
        out.append(token)
    assert out[-1] in eos
    jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)


def test_uncompilable_schemas_are_value_errors() -> None:
    check_response_format(_format(SCHEMA))
    for bad in ({"type": "nope"}, {"$ref": "#/$defs/missing"},
                {"type": "string", "pattern": "(("}):
        with pytest.raises(ValueError, match="cannot be compiled"):
            check_response_format(_format(bad))


def test_response_format_is_checked_on_construction() -> None:
    assert SamplingParams(1, response_format=OBJECT).response_format == OBJECT
    for bad in ("{", '{"type":"text"}', '{"type":"json_schema"}', "[1]"):
        with pytest.raises(ValueError, match="response_format"):
            SamplingParams(1, response_format=bad)


def test_byte_tokenizer_models_take_grammars_too() -> None:
    """Dummy models (bytes as tokens): their raw vocabulary still yields JSON."""
    tok = ByteTokenizer(300)
    grammars = Grammars(lambda: tokenizer_info(tok, 300, (tok.eos_token_id,)))
    matcher = grammars.matcher(SamplingParams(4, response_format=OBJECT))
    [(token, _, _)] = sample(torch.zeros(1, 300), [SamplingParams(1, temperature=0)], [None],
                             grammars.bitmask([matcher]))
    assert tok.decode([token]) == "{"


def _tools_tag(required: bool) -> str:
    """Tool calls as services/router/structured.py asks for them: free text with calls
    ("auto") or calls only ("required"), one call at most."""
    tag = {"type": "tag", "begin": '<tool_call>{"name": "person", "arguments": ',
           "content": {"type": "json_schema", "json_schema": SCHEMA}, "end": "}</tool_call>"}
    fmt: dict = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [tag]}
    if required:
        fmt = {"type": "tags_with_separator", "separator": "\n", "tags": [tag],
               "at_least_one": True}
    fmt["stop_after_first"] = True
    return json.dumps({"type": "structural_tag", "format": fmt})


def _accepts(grammars: Grammars, tok: Tokenizer, fmt: str, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` accepted, the answer may then end: EOS accepted)."""
    matcher = grammars.matcher(SamplingParams(4, response_format=fmt))
    ok = all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False))
    return ok, ok and matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()


def test_structural_tag_forces_the_call_after_its_trigger(
        grammars: Grammars, model: tuple[Tokenizer, int, tuple[int, ...]]) -> None:
    tok, _, _ = model
    call = '<tool_call>{"name": "person", "arguments": {"name": "Ann", "age": 3, "tags": ' \
           '["a"]}}</tool_call>'
    auto, required = _tools_tag(False), _tools_tag(True)
    check_response_format(auto)
    assert _accepts(grammars, tok, auto, "Any text <b>") == (True, True)
    assert _accepts(grammars, tok, auto, "Sure. " + call) == (True, True)
    assert _accepts(grammars, tok, auto, call + " more")[0] is False  # one call: the end
    assert _accepts(grammars, tok, auto, "Sure. <tool_call>") == (True, False)
    assert _accepts(grammars, tok, auto, call.replace(": 3", ":3"))[0] is False  # spacing
    assert _accepts(grammars, tok, auto, call.replace("person", "other"))[0] is False
    assert _accepts(grammars, tok, auto, call.replace('"a"', '"c"'))[0] is False  # schema
    assert _accepts(grammars, tok, required, "Sure. " + call)[0] is False  # calls only
    assert _accepts(grammars, tok, required, call) == (True, True)
    with pytest.raises(ValueError, match="cannot be compiled"):
        check_response_format(auto.replace('"integer"', '"nonsense"'))


@pytest.mark.parametrize("seed", [0, 1])
def test_random_logits_under_a_required_tag_give_a_valid_call(
        grammars: Grammars, model: tuple[Tokenizer, int, tuple[int, ...]],
        seed: int) -> None:
    tok, vocab, eos = model
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(400, temperature=1.0, response_format=_tools_tag(True))
    matcher = grammars.matcher(params)
    out: list[int] = []
    while not matcher.is_terminated():
        [(token, _, _)] = sample(torch.randn(1, vocab, generator=gen) * 3, [params], [gen],
                                 grammars.bitmask([matcher]))
        assert matcher.accept_token(token) and len(out) < 400
        out.append(token)
    text = tok.decode(out)
    head, tail = '<tool_call>{"name": "person", "arguments": ', "}</tool_call>"
    assert text.startswith(head) and text.endswith(tail), text
    jsonschema.validate(json.loads(text[len(head):-len(tail)]), SCHEMA)


def test_a_continuation_s_grammar_goes_on_after_its_resumed_tokens(
        grammars: Grammars, model: tuple[Tokenizer, int, tuple[int, ...]]) -> None:
    """A stream cut after '{"name' (services/router/resume.py): the continuation's first
    token is masked as the grammar stands there, and a token the grammar refused before
    cannot be resumed."""
    tok, vocab, _ = model
    resumed = tuple(tok.encode('{"name', add_special_tokens=False))
    logits = torch.zeros(vocab)
    logits[tok.encode("{", add_special_tokens=False)[0]] = 10.0  # a second "{": refused
    params = SamplingParams(16, temperature=0, response_format=_format(SCHEMA),
                            resumed=resumed)
    [first] = sample_first(logits, params, grammars)
    assert tok.decode([first.token]) != "{"
    assert grammars.matcher(params).accept_token(first.token)
    with pytest.raises(GrammarError, match="breaks the response format"):
        grammars.matcher(SamplingParams(16, response_format=_format(SCHEMA),
                                        resumed=tuple(tok.encode("Hi", add_special_tokens=False))))
