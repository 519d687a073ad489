"""/tokenize and /detokenize over HTTP on the router subprocess (conftest.py): the ids a
generation request is submitted with, round trips, and OpenAI-shaped 400s."""
from __future__ import annotations

from tests.router.fake_cluster import FakeCluster
from tests.router.http_client import request

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]


def test_tokenize_gives_the_submitted_ids(router: str, fake: FakeCluster) -> None:
    for path, body, prompt in [("/v1/chat/completions", {"messages": USER}, {"messages": USER}),
                               ("/v1/completions", {"prompt": "Say hello"},
                                {"prompt": "Say hello"})]:
        assert request(router, "POST", path, body={**body, "max_tokens": 2}).status == 200
        reply = request(router, "POST", "/tokenize", body=prompt)
        assert reply.status == 200, reply.body
        out = reply.json()
        assert out["tokens"] == list(fake.submits()[-1].token_ids)
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 8192
        assert out["token_strs"] is None


def test_detokenize_round_trip(router: str) -> None:
    ids = request(router, "POST", "/tokenize", body={"prompt": "Paris is lovely"}).json()
    reply = request(router, "POST", "/detokenize", body={"tokens": ids["tokens"]})
    assert reply.status == 200 and reply.json() == {"prompt": "Paris is lovely"}


def test_bad_bodies_are_400(router: str) -> None:
    for path, raw, param in [("/tokenize", b"{nope", None),
                             ("/tokenize", b'{"prompt": 5}', "prompt"),
                             ("/tokenize", b'{"prompt": "a", "echo": true}', "echo"),
                             ("/detokenize", b'{"tokens": [99999999]}', "tokens"),
                             ("/detokenize", b"[]", None)]:
        reply = request(router, "POST", path, raw=raw)
        assert reply.status == 400, (path, raw, reply.body)
        err = reply.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert request(router, "GET", "/tokenize").status == 405
