"""Every malformed request is a 400 with an OpenAI error body, and reaches no conductor."""
from __future__ import annotations

from typing import Any, Optional

import pytest

from tests.router.fake_cluster import FakeCluster
from tests.router.http_client import request

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
C = {"messages": USER}


def case(path: str, body: Any, param: Optional[str], code: Optional[str],
         raw: Optional[bytes] = None) -> tuple:
    return (path, body, raw, param, code)


CASES = [
    case(CHAT, None, None, "invalid_json", raw=b"{not json"),
    case(CHAT, None, None, "invalid_json", raw=b""),
    case(CHAT, [1, 2], None, None),
    case(CHAT, dict(C, model="gpt-4o"), "model", "model_not_found"),
    case(CHAT, {"messages": "hi"}, "messages", "invalid_value"),
    case(CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "invalid_value"),
    case(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "invalid_type"),
    case(CHAT, dict(C, max_tokens=0), "max_tokens", "invalid_value"),
    case(CHAT, dict(C, max_tokens="9"), "max_tokens", "invalid_value"),
    case(CHAT, dict(C, temperature=2.5), "temperature", "invalid_value"),
    case(CHAT, dict(C, temperature="hot"), "temperature", "invalid_type"),
    case(CHAT, dict(C, top_p=1.5), "top_p", "invalid_value"),
    case(CHAT, dict(C, top_k=-2), "top_k", "invalid_value"),
    case(CHAT, dict(C, seed="s"), "seed", "invalid_type"),
    case(CHAT, dict(C, stop=["a", "b", "c", "d", "e"]), "stop", "invalid_value"),
    case(CHAT, dict(C, stop=3), "stop", "invalid_type"),
    case(CHAT, dict(C, n=17), "n", "invalid_value"),
    case(CHAT, dict(C, stream="yes"), "stream", "invalid_type"),
    case(CHAT, dict(C, stream=True, stream_options=1), "stream_options", "invalid_type"),
    case(CHAT, dict(C, logprobs="yes"), "logprobs", "invalid_type"),
    case(CHAT, dict(C, max_tokens=8192), "messages", "context_length_exceeded"),
    case(CHAT, {"messages": [{"role": "user", "content": "word " * 9000}]}, "messages",
         "context_length_exceeded"),
    case(COMPL, {}, "prompt", "missing_required_parameter"),
    case(COMPL, {"prompt": ""}, "prompt", "invalid_value"),
    case(COMPL, {"prompt": []}, "prompt", "invalid_value"),
    case(COMPL, {"prompt": [1, -1]}, "prompt", "invalid_value"),
    case(COMPL, {"prompt": [1, 49152]}, "prompt", "invalid_value"),
    case(COMPL, {"prompt": [1] * 8000, "max_tokens": 500}, "prompt",
         "context_length_exceeded"),
    case(COMPL, {"prompt": [1] * 8192}, "prompt", "context_length_exceeded"),
    case(COMPL, {"prompt": "x", "logprobs": 9}, "logprobs", "invalid_value"),
]


@pytest.mark.parametrize("path,body,raw,param,code", CASES)
def test_bad_request_is_400(router: str, fake: FakeCluster, path: str, body: Any,
                            raw: Optional[bytes], param: Optional[str],
                            code: Optional[str]) -> None:
    submitted = len(fake.submits())
    reply = request(router, "POST", path, body=body, raw=raw)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == \
        ("invalid_request_error", param, code)
    assert error["message"]
    assert len(fake.submits()) == submitted


def test_unknown_route_and_method(router: str) -> None:
    reply = request(router, "GET", "/v1/nothing")
    assert reply.status == 404
    assert reply.json()["error"]["code"] == "not_found"
    reply = request(router, "GET", CHAT)
    assert reply.status == 405
    assert reply.json()["error"]["code"] == "method_not_allowed"


def test_server_survives_errors(router: str) -> None:
    for raw in (b"\xff\xfe", b"null", b"1e999999", b"{\"messages\": [{}]}"):
        assert request(router, "POST", CHAT, raw=raw).status == 400
    assert request(router, "GET", "/v1/models").status == 200
