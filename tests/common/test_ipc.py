"""The wire codec: round trips, and malformed frames rejected with a reason."""
from __future__ import annotations

import pytest

from common.ipc import ProtocolError, decode, encode
from common.protocol import KVReady, PrefillTask, SubmitRequest, TokenDelta


def test_round_trip_keeps_every_field() -> None:
    msg = PrefillTask("r1", [1, 2, 3], {"max_tokens": 4}, "decode-0", "tcp://h:1", "h:2",
                      1 << 40, [7, 8], 123.5, "tcp://h:3")
    assert decode(encode(msg)) == msg


def test_optional_fields_default_and_accept_none() -> None:
    msg = KVReady("r", 5, None, 10, 0)
    assert decode(encode(msg)) == msg
    delta = decode(b'{"type":"TokenDelta","request_id":"r","token_ids":[],"text":"",'
                   b'"logprobs":null,"finish_reason":"stop","prompt_tokens":1,'
                   b'"completion_tokens":1}')
    assert delta == TokenDelta("r", [], "", None, "stop", 1, 1, 0)


@pytest.mark.parametrize("frame, reason", [
    (b"not json", "not JSON"),
    (b"[1,2]", "no message type"),
    (b'{"type":"Nope"}', "unknown message type"),
    (b'{"type":"KVReady","request_id":"r"}', "lacks field"),
    (b'{"type":"KVReady","request_id":1,"first_token":1,"first_logprob":null,'
     b'"prompt_tokens":1,"cached_tokens":0}', "wrong type"),
    (b'{"type":"KVReady","request_id":"r","first_token":true,"first_logprob":null,'
     b'"prompt_tokens":1,"cached_tokens":0}', "wrong type"),
    (b'{"type":"SubmitRequest","request_id":"r","token_ids":[1,"x"],"block_keys":[],'
     b'"sampling":{},"arrival_time":1}', "wrong type"),
    (b'{"type":"KVReady","request_id":"r","first_token":1,"first_logprob":null,'
     b'"prompt_tokens":1,"cached_tokens":0,"extra":1}', "unknown fields"),
])
def test_malformed_frames_are_rejected(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(frame)


def test_float_fields_accept_ints() -> None:
    msg = decode(b'{"type":"SubmitRequest","request_id":"r","token_ids":[1],"block_keys":[],'
                 b'"sampling":{},"arrival_time":1}')
    assert isinstance(msg, SubmitRequest) and msg.arrival_time == 1
