"""The live cluster page end to end: a real cluster (2 prefill workers, 1 decode, a store)
serves a few requests; the dashboard's JSON agrees with the router's, the conductor's and
the store master's /metrics; ``crescent status`` prints the same numbers; and Debian's
headless chromium loads /dashboard with no console error, one row per worker, the
numbers of the JSON, and leaves a screenshot in test-artifacts/dashboard.png."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster, wait_no_leaks
from tests.e2e.test_pipeline import wait_index
from tests.router.dashboard_state import running_router, state

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CONTEXT = " ".join(f"Item {i}: the {w} sits on shelf {i * 5 % 17}." for i, w in
                   enumerate(["cup", "saw", "hat", "fan", "jar", "box", "pin", "mug"] * 5))
QUESTIONS = ["Where is the cup?", "Where is the hat?", "Where is the jar?", "Where is the pin?"]
# the burst's: uncached and twice as long, so the first of it to arrive is still waiting
# for its prefill when the others come (on a busy machine a cached prompt's prefill could
# end between two of them, and none was refused)
BURST_CONTEXT = " ".join(f"Box {i} holds {i * 7 % 23} {w}s." for i, w in
                         enumerate(["nail", "bolt", "gear", "cog", "nut", "rod"] * 14))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Round robin: consecutive requests go to different prefill workers, so the second
    # one loads the shared context from the store (a global hit) and later ones reuse
    # their own worker's cache (local hits). max_queue = 1: a request arriving while
    # another waits for its prefill is refused (429 queue_full).
    c = start_cluster(tmp_path_factory.mktemp("dashboard"), http=21200, base=21220,
                      prefill=2, scheduler="round_robin",
                      extra="max_queue = 1\nmetrics_port = 21240")
    yield c
    c.stop()


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=5).text


def _sum(text: str, name: str, labels: str = "") -> float:
    """The sum of every sample of ``name`` (``_total`` for counters) whose labels contain
    ``labels``."""
    pattern = rf"^{name}(?:_total)?(?:{{([^}}]*)}})? ([0-9.e+-]+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.M)
               if labels in (m.group(1) or ""))


def _data(c: LocalCluster) -> dict[str, Any]:
    r = httpx.get(c.url + "/debug/dashboard", timeout=5)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for(c: LocalCluster, ok: Callable[[dict[str, Any]], bool],
              timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        d = _data(c)
        if ok(d):
            return d
        if time.monotonic() > deadline:
            raise AssertionError(f"dashboard data never settled: {json.dumps(d)[:2000]}")
        time.sleep(0.2)


def _ask(c: LocalCluster, question: str, context: str = CONTEXT) -> httpx.Response:
    return httpx.post(c.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": context},
                     {"role": "user", "content": question}]})


@dataclass
class Served:
    data: dict[str, Any]  # the dashboard's, once everything below has settled
    ok: int  # requests answered 200
    refused: int  # answered 429 (queue_full)


@pytest.fixture(scope="module")
def served(cluster: LocalCluster) -> Served:
    """One at a time, then a burst of three at once (most of which are refused)."""
    for q in QUESTIONS:
        r = _ask(cluster, q)
        assert r.status_code == 200, r.text
        # the put of the context's blocks lands before the next request
        wait_index(cluster, r.json()["usage"]["prompt_tokens"] // cluster.config.block_size)
    with ThreadPoolExecutor(3) as pool:
        burst = [r.status_code for r in pool.map(lambda q: _ask(cluster, q, BURST_CONTEXT),
                                                 QUESTIONS[:3])]
    assert set(burst) <= {200, 429} and 429 in burst, burst
    ok, refused = len(QUESTIONS) + burst.count(200), burst.count(429)
    wait_no_leaks(cluster)
    d = _wait_for(cluster, lambda d: (
        d["ready"] and d["store"] is not None and d["store"]["age_s"] < 2.0
        and d["cache"] is not None and d["admission"]["conductor"]["placed"] == ok
        and len(d["requests"]) == ok + refused
        and all(r["transfer_bytes"] > 0 for r in d["requests"] if r["status"] == 200)
        and all(w["used_blocks"] == 0 for w in d["workers"])))
    return Served(d, ok, refused)


def test_data_matches_metrics(cluster: LocalCluster, served: Served) -> None:
    d, ok, refused = served.data, served.ok, served.refused
    cfg = cluster.config
    pools = httpx.get(cluster.url + "/debug/pools", timeout=5).json()["instances"]
    assert sorted(w["instance_id"] for w in d["workers"]) == \
        sorted(p["instance_id"] for p in pools)
    assert sorted(w["role"] for w in d["workers"]) == ["decode", "prefill", "prefill"]
    for w in d["workers"]:
        assert w["free_blocks"] + w["used_blocks"] <= w["total_blocks"]
        assert w["heartbeat_age_s"] < 2.0
    # the router's own counters
    router = _metrics(cluster.url)
    assert d["admission"]["http"] == {"200": ok, "429": refused}
    assert _sum(router, "crescent_router_requests", 'status="200"') == ok
    assert d["admission"]["rejected_429"] == refused == \
        _sum(router, "crescent_router_requests", 'status="429"')
    # the conductor's
    conductor = _metrics(f"http://{cfg.host}:{cfg.port('conductor_http')}")
    assert d["transfer"]["bytes"] == \
        _sum(conductor, "crescent_conductor_kv_transfer_bytes") > 0
    assert d["transfer"]["transfers"] == ok == \
        _sum(conductor, "crescent_conductor_kv_transfer_seconds_count")
    assert sum(r["transfer_bytes"] for r in d["requests"]) == d["transfer"]["bytes"]
    cache, cond = d["cache"], d["admission"]["conductor"]
    assert cond["placed"] == _sum(conductor, "crescent_conductor_placed") == ok
    assert cond["rejected"] == {"queue_full": refused} and cond["failed"] == {}
    assert refused == _sum(conductor, "crescent_conductor_rejected", 'reason="queue_full"')
    assert cache["prompt_tokens"] == _sum(conductor, "crescent_prompt_tokens") > 0
    assert cache["global_hit_tokens"] == _sum(conductor, "crescent_global_cache_hit_tokens")
    assert cache["local_hit_tokens"] + cache["global_hit_tokens"] == \
        _sum(conductor, "crescent_cached_tokens")
    assert cache["global_hit_tokens"] > 0, "the second prefill worker loads from the store"
    assert cache["local_hit_tokens"] > 0, "later requests reuse their worker's cache"
    assert cache["local_hit_rate"] == pytest.approx(
        cache["local_hit_tokens"] / cache["prompt_tokens"])
    # the store master's
    store = d["store"]
    master = _metrics(f"http://{cfg.host}:{cfg.port('store_master_http')}")
    assert store["dram_used"] == _sum(master, "store_used_bytes", 'tier="dram"') > 0
    assert store["dram_capacity"] == _sum(master, "store_capacity_bytes", 'tier="dram"')
    assert store["objects"] == _sum(master, "store_objects") > 0
    assert store["nodes"] == cfg.store.nodes
    assert store["counters"]["hits"] > 0 and store["index_state"] == "live"
    assert store["index_keys"] == store["objects"]


def test_timelines(served: Served) -> None:
    reqs = served.data["requests"]
    assert sorted(r["status"] for r in reqs) == [200] * served.ok + [429] * served.refused
    assert [r["status"] for r in reqs[-len(QUESTIONS):]] == [200] * len(QUESTIONS)
    assert [r["ended"] for r in reqs] == sorted((r["ended"] for r in reqs),
                                                reverse=True), "the last to end first"
    for r in (r for r in reqs if r["status"] == 429):  # refused: waited, nothing else
        assert r["phases"]["queued"] > 0 and r["output_tokens"] == 0 and not r["prefill_id"]
        assert r["phases"]["prefill"] == r["phases"]["decode"] == 0
    for r in (r for r in reqs if r["status"] == 200):
        p = r["phases"]
        assert p["prefill"] > 0 and p["decode"] > 0 and p["queued"] >= 0
        assert p["transfer"] >= 0
        assert sum(p.values()) == pytest.approx(r["ended"] - r["arrival"], abs=0.05)
        assert r["output_tokens"] == 8 and r["prompt_tokens"] > 100
        assert r["prefill_id"].startswith("prefill") and r["decode_id"].startswith("decode")
    assert any(r["cached_tokens"] > 0 for r in reqs)


def test_crescent_status(cluster: LocalCluster, served: Served) -> None:
    cli = [sys.executable, "-m", "launch.cli", "status", "--url", cluster.url]
    out = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    d = served.data
    for w in d["workers"]:  # instance, role, used, free, total, cached, ...
        row = next(line.split() for line in text.splitlines()
                   if line.split()[:1] == [w["instance_id"]])
        assert row[1:6] == [w["role"], *(f"{w[k]:,}" for k in (
            "used_blocks", "free_blocks", "total_blocks", "cached_blocks"))]
    for line in (rf"placed\s+{served.ok}", rf"refused 429\s+{served.refused}",
                 rf"HTTP outcomes\s+200: {served.ok}, 429: {served.refused}",
                 rf"rejected by reason\s+queue_full: {served.refused}"):
        assert re.search(rf"^\s*{line}(\s|$)", text, re.M), line
    for r in d["requests"][:10]:
        assert r["request_id"] in text
    as_json = subprocess.run(cli + ["--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
    assert as_json.returncode == 0, as_json.stderr
    got = json.loads(as_json.stdout)
    assert [(w["instance_id"], w["total_blocks"]) for w in got["workers"]] == \
        [(w["instance_id"], w["total_blocks"]) for w in d["workers"]]
    assert got["admission"]["conductor"] == d["admission"]["conductor"]
    refused = subprocess.run([sys.executable, "-m", "launch.cli", "status", "--url",
                              "http://127.0.0.1:21299"], cwd=REPO, capture_output=True,
                             text=True, timeout=30)
    assert refused.returncode == 1 and "cannot read" in refused.stderr


CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed "
                    "(apt-get install chromium chromium-driver; launch/setup.sh does as root)")
    webdriver = pytest.importorskip("selenium.webdriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1500,1400", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


# What the page shows, read in one go: it redraws every second, so element handles held
# across calls go stale. Worker rows and admission cells by their data attributes.
SHOWN_JS = """
const text = (id) => document.getElementById(id).textContent;
const cells = (root) => Object.fromEntries([...root.querySelectorAll("td[data-k]")]
    .map((td) => [td.dataset.k, td.textContent]));
return {
  updated: document.body.dataset.updated || null, health: text("health"),
  workers: Object.fromEntries([...document.querySelectorAll("#workers tr[data-worker]")]
      .map((tr) => [tr.dataset.worker, cells(tr)])),
  admission: cells(document.getElementById("admission")),
  requests: [...document.querySelectorAll("#requests tr[data-request]")]
      .map((tr) => tr.dataset.request),
  rejected_429: text("rejected_429"), local: text("local_hit_rate"),
  global: text("global_hit_rate"),
  steps: [...document.querySelectorAll("#worker_metrics tr[data-worker]")]
      .map((tr) => [tr.dataset.worker, tr.dataset.step, cells(tr).steps]),
};
"""


def test_page_in_headless_chromium(cluster: LocalCluster, served: Served,
                                   browser: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(cluster.url + "/dashboard")
    WebDriverWait(browser, 30).until(lambda b: b.execute_script(SHOWN_JS)["updated"])
    shown = browser.execute_script(SHOWN_JS)
    d = _data(cluster)  # idle: the same numbers as when the page drew (heartbeats aside)
    assert sorted(shown["workers"]) == sorted(w["instance_id"] for w in d["workers"])
    for w in d["workers"]:
        row = shown["workers"][w["instance_id"]]
        for key in ("used_blocks", "free_blocks", "cached_blocks", "queued", "running",
                    "assigned"):
            assert row[key] == f"{w[key]:,}", (w["instance_id"], key)
    adm = shown["admission"]
    assert adm["http:200"] == str(d["admission"]["http"]["200"]) == str(served.ok)
    assert adm["http:429"] == str(served.refused) == adm["refused:queue_full"]
    assert adm["placed"] == str(d["admission"]["conductor"]["placed"])
    assert shown["rejected_429"] == str(served.refused)
    cache = d["cache"]
    assert shown["global"] == f"{100 * cache['global_hit_rate']:.1f} %"
    assert shown["local"] == f"{100 * cache['local_hit_rate']:.1f} %"
    assert shown["requests"] == [r["request_id"] for r in d["requests"]]
    assert shown["health"] == "ready"
    # each worker's own /metrics: a row per step kind it ran (a store node: none, "–")
    assert {w for w, _, _ in shown["steps"]} == {w["worker"] for w in d["worker_metrics"]}
    assert {(w, kind) for w, kind, n in shown["steps"] if n not in ("–", "")} >= {
        ("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")}
    time.sleep(2.5)  # a few refreshes: none of them may log an error
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    assert float(browser.execute_script(SHOWN_JS)["updated"]) > d["time"], \
        "the page refreshes itself"


def test_page_asks_for_the_api_key(browser: Any) -> None:
    """A router with API keys (no cluster behind it): the page shows a key field on the
    data's 401, then the data once given the key; the 401s are the only console errors."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with running_router(state(api_keys=["k1"]), 21296) as url:
        browser.get(url + "/dashboard")
        keybox = browser.find_element(By.ID, "keybox")
        WebDriverWait(browser, 15).until(lambda b: keybox.is_displayed())
        assert browser.execute_script(SHOWN_JS)["updated"] is None
        browser.find_element(By.ID, "key").send_keys("k1")
        browser.find_element(By.CSS_SELECTOR, "#keyform button").click()
        WebDriverWait(browser, 15).until(lambda b: b.execute_script(SHOWN_JS)["updated"])
        assert sorted(browser.execute_script(SHOWN_JS)["workers"]) == ["decode-0", "prefill-0"]
        assert not keybox.is_displayed()
        logs = browser.get_log("browser")
    assert logs and all("401" in e["message"] for e in logs), logs
