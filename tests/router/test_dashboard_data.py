"""The dashboard's JSON from a router state: the conductor's status, the router's own
counters and its request log; the two routes, open page and guarded data."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

import pytest
from aiohttp.test_utils import TestClient, TestServer

from common.status_protocol import ClusterStatus, ConductorTotals
from services.router.app import build_app
from services.router.dashboard_data import dashboard_data
from services.router.state import RouterState
from tests.router.dashboard_state import WORKERS, serve_one, state


def test_numbers_come_from_status_metrics_and_log() -> None:
    s = state()
    now = time.time()
    serve_one(s, "a", 200, now)
    serve_one(s, "b", 429, now)
    d = dashboard_data(s, now)
    assert d["ready"] and d["model"] == "tiny" and d["conductor_epoch"] == 5
    assert (d["router"], d["routers"]) == ("router-0", 1)
    assert [w["instance_id"] for w in d["workers"]] == ["decode-0", "prefill-0"]
    assert d["workers"][1] == {
        "instance_id": "prefill-0", "role": "prefill", "total_blocks": 512,
        "free_blocks": 500, "used_blocks": 12, "queued": 3, "running": 0, "assigned": 4,
        "queued_tokens": 900, "context_tokens": 0, "cached_blocks": 40, "draining": False,
        "heartbeat_age_s": 0.1}
    assert d["cache"] == {"prompt_tokens": 1000, "local_hit_tokens": 250,
                          "global_hit_tokens": 150, "local_hit_rate": 0.25,
                          "global_hit_rate": 0.15}
    assert d["store"]["hit_rate"] == 0.75 and d["store"]["dram_used"] == 3 << 20
    # the conductor's totals, as its last status told them; rates from their growth
    assert (d["transfer"]["bytes"], d["transfer"]["transfers"]) == ((1 << 20) + 4096, 7)
    assert d["transfer"]["seconds"] == pytest.approx(1.7)
    assert d["transfer"]["bytes_per_s"] == 4096 / 10
    assert d["transfer"]["bandwidth_bytes_per_s"] == pytest.approx(4096 / 0.2)
    a = d["admission"]
    assert a["http"] == {"200": 1, "429": 1} and a["rejected_429"] == 1
    assert a["admitted_per_s"] == 0.1 and a["rejected_per_s"] == 0.1
    assert a["conductor"] == {"placed": 7, "rejected": {"ttft_slo": 2},
                              "failed": {"timeout": 1}}
    assert [r["request_id"] for r in d["requests"]] == ["b", "a"]
    assert d["requests"][1]["phases"] == pytest.approx(
        {"queued": 0.3, "prefill": 0.4, "transfer": 0.1, "decode": 0.0}, abs=1e-6)


def test_sections_the_cluster_does_not_report_are_none() -> None:
    s = state()
    s.status = None
    d = dashboard_data(s, time.time())
    assert not d["ready"] and d["workers"] == [] and d["conductor_epoch"] is None
    assert d["store"] is None and d["cache"] is None and d["admission"]["conductor"] is None
    assert d["transfer"] is None
    s._on_status(ClusterStatus(True, WORKERS))  # an older conductor: no totals, no store
    d = dashboard_data(s, time.time())
    assert len(d["workers"]) == 2 and d["store"] is None and d["cache"] is None
    assert d["transfer"] is None
    no_prompts = ConductorTotals()
    s._on_status(ClusterStatus(True, [], 1, no_prompts, None))
    assert dashboard_data(s, time.time())["cache"]["local_hit_rate"] is None


async def _get(s: RouterState, *paths: str, key: Optional[str] = None
               ) -> list[tuple[int, str, Any]]:
    client = TestClient(TestServer(build_app(s)))
    await client.start_server()
    try:
        out = []
        for path in paths:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            resp = await client.get(path, headers=headers)
            body = await (resp.json() if resp.content_type == "application/json"
                          else resp.text())
            out.append((resp.status, resp.content_type, body))
            if path == "/dashboard":
                assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        return out
    finally:
        await client.close()


def test_routes_open_page_and_data() -> None:
    (ps, ptype, page), (ds, dtype, data) = asyncio.run(
        _get(state(), "/dashboard", "/debug/dashboard"))
    assert (ps, ptype, ds, dtype) == (200, "text/html", 200, "application/json")
    assert "/debug/dashboard" in page and "<script" in page
    assert "http://" not in page and "https://" not in page, "no external resource"
    assert [w["instance_id"] for w in data["workers"]] == ["decode-0", "prefill-0"]


def test_with_api_keys_the_data_needs_one_the_page_does_not() -> None:
    s = state(api_keys=["sekret"])
    (ps, _, _), (ds, _, body) = asyncio.run(_get(s, "/dashboard", "/debug/dashboard"))
    assert (ps, ds) == (200, 401) and body["error"]["code"] == "invalid_api_key"
    [(ds, _, data)] = asyncio.run(_get(s, "/debug/dashboard", key="sekret"))
    assert ds == 200 and len(data["workers"]) == 2
