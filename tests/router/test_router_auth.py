"""API keys on the router (services/router/auth.py): a router subprocess with keys from
the config and from a key file, behind its own scripted fake cluster."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import openai
import pytest

from common.security import SecurityConfig
from common.service import StartupError
from services.router.auth import load_api_keys
from tests.router.conftest import own_router
from tests.router.fake_cluster import WORDS, FakeCluster
from tests.router.http_client import request

KEY, FILE_KEY = "sk-crescent-test-1", "sk-from-the-file"
CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Say hello"}],
        "max_tokens": 8}
def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


REFUSED = {"type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, FakeCluster]]:
    """(base URL, fake cluster) of a router that requires one of two keys."""
    tmp = tmp_path_factory.mktemp("router-auth")
    (tmp / "keys.txt").write_text(f"# one key per line\n\n  {FILE_KEY}  \n")
    with own_router(tmp, f"request_timeout_s = 1.5\nheartbeat_interval_s = 0.2\n"
                         f"[security]\napi_keys = [\"{KEY}\"]\n"
                         f"api_key_file = \"{tmp / 'keys.txt'}\"\n") as running:
        yield running


MISSING, WRONG = "You didn't provide an API key", "Incorrect API key provided."


@pytest.mark.parametrize("headers,message", [
    ({}, MISSING), (bearer("sk-wrong"), WRONG), (bearer(KEY + "x"), WRONG),
    ({"Authorization": KEY}, MISSING), ({"Authorization": f"Basic {KEY}"}, MISSING),
    (bearer(""), MISSING)])
@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"),
                                         ("POST", "/v1/completions"), ("GET", "/v1/models"),
                                         ("GET", "/v1/no-such-route"), ("GET", "/debug/pools")])
def test_guarded_paths_refuse_without_a_valid_key(keyed: tuple[str, FakeCluster],
                                                  headers: dict, message: str,
                                                  method: str, path: str) -> None:
    url, fake = keyed
    before = len(fake.submits())
    reply = request(url, method, path, body=CHAT if method == "POST" else None,
                    headers=headers)
    assert reply.status == 401
    assert reply.headers["www-authenticate"] == 'Bearer realm="crescent"'
    error = reply.json()["error"]
    assert {k: error[k] for k in REFUSED} == REFUSED
    assert error["message"].startswith(message)
    assert len(fake.submits()) == before  # nothing reached the cluster


@pytest.mark.parametrize("key", [KEY, FILE_KEY])
def test_either_key_works_over_raw_http(keyed: tuple[str, FakeCluster], key: str) -> None:
    url, _ = keyed
    reply = request(url, "POST", "/v1/chat/completions", body=CHAT, headers=bearer(key))
    assert reply.status == 200
    assert reply.json()["choices"][0]["message"]["content"] == "".join(WORDS)
    assert request(url, "GET", "/debug/pools", headers=bearer(key)).json()["ready"] is True


def test_health_and_metrics_stay_open(keyed: tuple[str, FakeCluster]) -> None:
    url, _ = keyed
    assert request(url, "GET", "/health").json() == {"status": "ok"}
    metrics = request(url, "GET", "/metrics")
    assert metrics.status == 200 and b"crescent_router" in metrics.body


def test_the_api_listens_on_the_configured_host_only(keyed: tuple[str, FakeCluster]) -> None:
    port = urlsplit(keyed[0]).port
    with pytest.raises(ConnectionRefusedError), socket.create_connection(
            ("127.0.0.2", port), timeout=5):
        pass
    socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_official_openai_client_with_and_without_the_key(
        keyed: tuple[str, FakeCluster]) -> None:
    url, _ = keyed
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    out = good.chat.completions.create(model="smollm2-135m", messages=CHAT["messages"],
                                       max_tokens=8)
    assert out.choices[0].message.content == "".join(WORDS)
    assert [m.id for m in good.models.list()] == ["smollm2-135m"]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model="smollm2-135m", messages=CHAT["messages"])
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_load_api_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("a\n# b\n\n c \na\n")
    assert load_api_keys(SecurityConfig(api_keys=["x", "a"], api_key_file=str(keys))) == (
        b"x", b"a", b"c")
    assert load_api_keys(SecurityConfig()) == ()
    keys.write_text("# only a comment\n")
    with pytest.raises(StartupError, match="holds no key"):
        load_api_keys(SecurityConfig(api_key_file=str(keys)))
    with pytest.raises(StartupError, match="api_key_file"):
        load_api_keys(SecurityConfig(api_key_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="non-empty strings"):
        SecurityConfig(api_keys=["ok", " "])
