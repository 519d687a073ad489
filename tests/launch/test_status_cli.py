"""``crescent status`` without a cluster: the dashboard JSON of a router state (the real
builder) rendered as tables, fetched over HTTP from a real router app with and without
its API key, and the errors a user sees."""
from __future__ import annotations

import re
import time
from typing import Iterator

import pytest
from rich.console import Console

from launch.status import StatusError, fetch, main, render
from services.router.dashboard_data import dashboard_data
from tests.router.dashboard_state import running_router, serve_one, state


def test_render_shows_every_number() -> None:
    s = state()
    now = time.time()
    serve_one(s, "cmpl-a", 200, now)
    serve_one(s, "cmpl-b", 429, now)
    console = Console(record=True, width=160)
    render(dashboard_data(s, now), console)
    text = console.export_text()
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    assert rows["prefill-0"][1:12] == ["prefill", "12", "500", "512", "40", "3", "900", "0",
                                       "0", "4", "100"]
    assert rows["decode-0"][1:6] == ["decode", "24", "1,000", "1,024", "0"]
    for line in (r"DRAM\s+3\.0 MiB / 64\.0 MiB", r"SSD\s+0 B / 1\.0 GiB",
                 r"key hit rate\s+75\.0 % \(9 hits, 3 misses\)", r"placed\s+7",
                 r"refused 429\s+1 \(0\.1 /s\)", r"HTTP outcomes\s+200: 1, 429: 1",
                 r"rejected by reason\s+ttft_slo: 2", r"failed by reason\s+timeout: 1",
                 r"local cache hits\s+25\.0 % \(250 of 1,000 tokens\)",
                 r"global \(store\) hits\s+15\.0 % \(150 of 1,000 tokens\)",
                 r"global index\s+30 keys, live", r"cmpl-a\s+200\s+300 ms\s+400 ms\s+100 ms",
                 r"cmpl-b\s+429\s+1\.00 s\s+0 ms"):
        assert re.search(line, text), line


def test_render_names_each_requests_router_when_there_are_several() -> None:
    s = state()
    now = time.time()
    serve_one(s, "cmpl-a", 200, now)
    s.config.routers = 3
    theirs = [{**dashboard_data(s, now)["requests"][0], "request_id": "cmpl-z", "ended": now + 1}]
    console = Console(record=True, width=160)
    render(dashboard_data(s, now, ({"router-1": theirs}, ["router-2"])), console)
    text = console.export_text()
    assert re.search(r"router-0 of 3 routers answered \(its own rates\); no answer from "
                     r"router-2", text), text
    assert re.search(r"router-1\s+cmpl-z\s+200.*\n.*router-0\s+cmpl-a\s+200", text), text


@pytest.fixture(scope="module")
def router_url() -> Iterator[str]:
    """A real router app (keys: "k1") on a port of this file's range, in a thread."""
    with running_router(state(api_keys=["k1"]), 21298) as url:
        yield url


def test_fetch_with_and_without_the_key(router_url: str) -> None:
    data = fetch(router_url, "k1", timeout_s=5)
    assert [w["instance_id"] for w in data["workers"]] == ["decode-0", "prefill-0"]
    with pytest.raises(StatusError, match="answered 401 .*CRESCENT_API_KEY"):
        fetch(router_url, None, timeout_s=5)
    with pytest.raises(StatusError, match="answered 401"):
        fetch(router_url, "wrong", timeout_s=5)


def test_main_exit_codes(router_url: str, capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRESCENT_API_KEY", "k1")
    assert main(router_url, None, None, as_json=True, timeout_s=5, limit=10) == 0
    assert '"instance_id": "prefill-0"' in capsys.readouterr().out
    assert main("http://127.0.0.1:21297", None, None, False, 5, 10) == 1  # nothing there
    assert "cannot read http://127.0.0.1:21297" in capsys.readouterr().err
    assert main(None, "/nonexistent/cluster.toml", None, False, 5, 10) == 1
    assert "config /nonexistent/cluster.toml" in capsys.readouterr().err
