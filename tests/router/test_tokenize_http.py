"""/tokenize and /detokenize over HTTP on the router subprocess (conftest.py): the ids a
generation request is submitted with, round trips, and OpenAI-shaped 400s."""
from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.router.auth import api_key_middleware
from services.router.handlers import routes
from tests.router.fake_cluster import FakeCluster
from tests.router.http_client import request

USER = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say hello"}]


def test_tokenize_gives_the_submitted_ids(router: str, fake: FakeCluster) -> None:
    for path, prompt in [("/v1/chat/completions", {"messages": USER}),
                         ("/v1/completions", {"prompt": "Say hello"})]:
        assert request(router, "POST", path, body={**prompt, "max_tokens": 2}).status == 200
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


def test_api_keys_guard_the_tokenizer_endpoints() -> None:
    """With keys configured, /tokenize and /detokenize answer 401 without one, as /v1/*."""
    async def statuses() -> list[int]:
        app = web.Application(middlewares=[api_key_middleware((b"sk-1",))])
        app.add_routes(routes())
        async with TestClient(TestServer(app)) as client:
            out = []
            for path in ("/tokenize", "/detokenize"):
                resp = await client.post(path, json={"prompt": "x"})
                out.append(resp.status)
                assert (await resp.json())["error"]["code"] == "invalid_api_key"
            return out

    assert asyncio.run(statuses()) == [401, 401]
