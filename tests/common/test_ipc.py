"""The wire codec: round trips, and malformed frames rejected with a reason."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import orjson
import pytest

from common.ipc import ProtocolError, decode, encode, message
from common.kv.events import KVEvents
from common.protocol import (
    Fence, KVReady, PrefillTask, RequestRejected, SubmitRequest, TokenDelta, WorkerHeartbeat,
    WorkerLoad,
)
from common.sampling_params import SampledToken, SamplingParams, TopLogprobs
from common.scheduling import Rejection

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, top_k=3, seed=7, stop=("\n",),
                        stop_token_ids=(2,), logprobs=True)


def test_round_trip_keeps_every_field() -> None:
    msg = PrefillTask("r1", [1, 2, 3], ["ab" * 16], GREEDY, "decode-0", "tcp://h:1", "h:2",
                      1 << 40, [7, 8], 123.5)
    assert decode(encode(msg)) == msg


def test_nested_dataclasses_decode_into_their_types() -> None:
    sub = decode(encode(SubmitRequest("r", [1], [], GREEDY, 1.0)))
    assert type(sub.sampling) is SamplingParams and sub.sampling == GREEDY
    assert sub.sampling.stop == ("\n",) and sub.sampling.stop_token_ids == (2,)
    rejected = RequestRejected("r", Rejection("ttft_slo", 2.5, "predicted TTFT 3.50 s"))
    assert decode(encode(rejected)) == rejected
    beat = WorkerHeartbeat("d", "decode", WorkerLoad(1, 2, 3, 4), 5, 6, 11,
                           KVEvents(9, "s", ["ab"]), 9)
    assert decode(encode(beat)).load == WorkerLoad(1, 2, 3, 4)
    assert decode(encode(beat)).events == KVEvents(9, "s", ["ab"])


def test_nested_fields_are_json_objects_and_take_defaults() -> None:
    body = orjson.loads(encode(SubmitRequest("r", [1], [], SamplingParams(max_tokens=9), 0.0)))
    assert body["sampling"] == {"max_tokens": 9, "temperature": 1.0, "top_p": 1.0,
                                "top_k": None, "seed": None, "stop": [],
                                "stop_token_ids": [], "logprobs": False, "ignore_eos": False,
                                "top_logprobs": 0, "response_format": None, "n": 1,
                                "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                "logit_bias_ids": [], "logit_bias_values": [],
                                "prompt_logprobs": None, "resumed": [],
                                "resumed_chars": 0, "adapter": None}
    short = decode(b'{"type":"SubmitRequest","request_id":"r","token_ids":[1],'
                   b'"block_keys":[],"sampling":{"max_tokens":9},"arrival_time":0}')
    assert short.sampling == SamplingParams(max_tokens=9)


def test_optional_fields_default_and_accept_none() -> None:
    msg = KVReady("r", [SampledToken(5)], 10, 0)
    assert decode(encode(msg)) == msg
    delta = decode(b'{"type":"TokenDelta","request_id":"r","token_ids":[],"text":"",'
                   b'"logprobs":null,"finish_reason":"stop","prompt_tokens":1,'
                   b'"completion_tokens":1}')
    assert delta == TokenDelta("r", [], "", None, "stop", 1, 1, 0)


def test_top_logprobs_ride_as_nested_objects() -> None:
    top = TopLogprobs([7, 3], [-0.25, -1.5])
    for msg in (KVReady("r", [SampledToken(7, -0.25, top), SampledToken(3)], 10, 0,
                        Fence(1, 2)),
                TokenDelta("r", [7], "a", [-0.25], None, 1, 1, 0, [top], index=2)):
        assert decode(encode(msg)) == msg
    with pytest.raises(ProtocolError, match=r"top_logprobs\[0\] is invalid"):
        decode(encode(TokenDelta("r", [7], "a", [-0.25], None, 1, 1, 0, [top]))
               .replace(b'"token_ids":[7,3]', b'"token_ids":[7]'))


def _submit(sampling: bytes) -> bytes:
    return (b'{"type":"SubmitRequest","request_id":"r","token_ids":[1],"block_keys":[],'
            b'"sampling":' + sampling + b',"arrival_time":1}')


@pytest.mark.parametrize("frame, reason", [
    (b"not json", "not JSON"),
    (b"[1,2]", "no message type"),
    (b'{"type":"Nope"}', "unknown message type"),
    (b'{"type":"KVReady","request_id":"r"}', "KVReady lacks field first"),
    (b'{"type":"KVReady","request_id":1,"first":[{"token":1}],'
     b'"prompt_tokens":1,"cached_tokens":0}', "KVReady.request_id has the wrong type"),
    (b'{"type":"KVReady","request_id":"r","first":[{"token":true}],'
     b'"prompt_tokens":1,"cached_tokens":0}', "wrong type"),
    (b'{"type":"SubmitRequest","request_id":"r","token_ids":[1,"x"],"block_keys":[],'
     b'"sampling":{"max_tokens":1},"arrival_time":1}', "SubmitRequest.token_ids has the wrong"),
    (b'{"type":"KVReady","request_id":"r","first":[],'
     b'"prompt_tokens":1,"cached_tokens":0,"extra":1}', "unknown fields"),
    # A nested value is checked like a frame: shape, field types, names, its own rules.
    (_submit(b'[4]'), "SubmitRequest.sampling has the wrong type"),
    (_submit(b'null'), "SubmitRequest.sampling has the wrong type"),
    (_submit(b'{}'), "SubmitRequest.sampling lacks field max_tokens"),
    (_submit(b'{"max_tokens":"4"}'), "SubmitRequest.sampling.max_tokens has the wrong type"),
    (_submit(b'{"max_tokens":4,"stop":[1]}'), "SubmitRequest.sampling.stop has the wrong"),
    (_submit(b'{"max_tokens":4,"best_of":2}'), r"SubmitRequest.sampling has unknown fields \['best_of'\]"),
    (_submit(b'{"max_tokens":4,"n":0}'), "sampling is invalid: n must be in"),
    (_submit(b'{"max_tokens":-1}'), "SubmitRequest.sampling is invalid: max_tokens must be"),
    (_submit(b'{"max_tokens":4,"top_p":1.5}'), "sampling is invalid: top_p must be in"),
    (b'{"type":"RequestRejected","request_id":"r","rejection":{"reason":"slo_violation",'
     b'"retry_after_s":2}}', "RequestRejected.rejection is invalid: unknown rejection"),
    (b'{"type":"RequestRejected","request_id":"r","rejection":{"reason":"tbt_slo",'
     b'"retry_after_s":null}}', "RequestRejected.rejection.retry_after_s has the wrong type"),
])
def test_malformed_frames_are_rejected(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(frame)


def test_float_fields_accept_ints() -> None:
    msg = decode(_submit(b'{"max_tokens":1,"temperature":0}'))
    assert isinstance(msg, SubmitRequest) and msg.arrival_time == 1
    assert msg.sampling.temperature == 0 and msg.sampling.greedy


@dataclass(frozen=True)
class _Point:
    x: int
    y: int = 0


@message
class _Shapes:
    """Only for this test: every way a field may hold a nested dataclass."""

    one: _Point
    maybe: Optional[_Point]
    many: list[_Point]
    fixed: tuple[_Point, ...] = ()


def test_optional_list_and_tuple_of_nested_dataclasses() -> None:
    msg = _Shapes(_Point(1), None, [_Point(2, 3)], (_Point(4),))
    assert decode(encode(msg)) == msg
    assert decode(encode(_Shapes(_Point(1), _Point(5), [], ()))).maybe == _Point(5)
    with pytest.raises(ProtocolError, match=r"_Shapes.many\[1\].x has the wrong type"):
        decode(b'{"type":"_Shapes","one":{"x":1},"maybe":null,"many":[{"x":1},{"x":"a"}]}')
    with pytest.raises(ProtocolError, match="_Shapes.fixed has the wrong type"):
        decode(b'{"type":"_Shapes","one":{"x":1},"maybe":null,"many":[],"fixed":{"x":1}}')


@dataclass(frozen=True)
class FlatEvent:
    """Test only: a dataclass of required scalars, which a list decodes on a fast path."""
    seq: int
    kind: str
    key: str

    def __post_init__(self) -> None:
        if self.seq < 1:
            raise ValueError("seq must be positive")
        if self.kind not in ("stored", "removed"):
            raise ValueError("kind must be stored or removed")


@message
class FlatEventsCarrier:
    """Test only."""
    events: list[FlatEvent]


def _beat(events: bytes) -> bytes:
    return b'{"type":"FlatEventsCarrier","events":' + events + b'}'


@pytest.mark.parametrize("events, reason", [
    (b'[{"seq":1,"kind":"stored","key":"ab"},{"seq":true,"kind":"stored","key":"cd"}]',
     r"FlatEventsCarrier.events\[1\].seq has the wrong type"),
    (b'[{"seq":1,"kind":"stored","key":"ab","x":0}]', r"events\[0\] has unknown fields"),
    (b'[{"seq":1,"kind":"stored"}]', r"events\[0\] lacks field key"),
    (b'[{"seq":0,"kind":"stored","key":"ab"}]', r"events\[0\] is invalid: seq must be"),
    (b'[{"seq":1,"kind":"moved","key":"ab"}]', r"events\[0\] is invalid: kind must be"),
    (b'[["seq",1]]', r"events\[0\] has the wrong type"),
])
def test_flat_items_are_checked_item_by_item(events: bytes, reason: str) -> None:
    """Flat items (every field a required scalar) decode on a fast path; a bad one is
    named as on the general path."""
    with pytest.raises(ProtocolError, match=reason):
        decode(_beat(events))
    good = decode(_beat(b'[{"seq":1,"kind":"stored","key":"ab"},'
                        b'{"seq":2,"kind":"removed","key":"ab"}]'))
    assert good.events == [FlatEvent(1, "stored", "ab"), FlatEvent(2, "removed", "ab")]


WHOLE = [  # messages as the encoder sends them: every field present (the fast path)
    TokenDelta("r", [1, 2], "ab", [-0.5, -1.0], "stop", 3, 2,
               top_logprobs=[TopLogprobs([1], [-0.1])]),
    SubmitRequest("r", [1, 2, 3], ["ab" * 16], GREEDY, 1.0, router_inbox="tcp://h:1"),
    KVReady("r", [SampledToken(5, -0.25)], 3, 0),
]


@pytest.mark.parametrize("msg", WHOLE, ids=lambda m: type(m).__name__)
def test_whole_messages_round_trip_and_name_a_wrong_field(msg: object) -> None:
    """A message with every field takes the one-pass path; a field of the wrong type there
    is still refused, by name, as on the field-by-field path."""
    assert decode(encode(msg)) == msg
    body = orjson.loads(encode(msg))
    for name in body.keys() - {"type"}:
        wrong = dict(body, **{name: {"not": "this"}})
        with pytest.raises(ProtocolError, match=rf"\.{name} (has the wrong type|lacks|has unk)"):
            decode(orjson.dumps(wrong))
