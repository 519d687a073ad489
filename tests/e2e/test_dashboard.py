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
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster, wait_no_leaks

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CONTEXT = " ".join(f"Item {i}: the {w} sits on shelf {i * 5 % 17}." for i, w in
                   enumerate(["cup", "saw", "hat", "fan", "jar", "box", "pin", "mug"] * 5))
QUESTIONS = ["Where is the cup?", "Where is the hat?", "Where is the jar?", "Where is the pin?"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # Round robin: consecutive requests go to different prefill workers, so the second
    # one loads the shared context from the store (a global hit) and later ones reuse
    # their own worker's cache (local hits).
    c = start_cluster(tmp_path_factory.mktemp("dashboard"), http=21200, base=21220,
                      prefill=2, scheduler="round_robin")
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


@pytest.fixture(scope="module")
def served(cluster: LocalCluster) -> dict[str, Any]:
    """The dashboard data once the requests are done and every report has arrived."""
    for q in QUESTIONS:
        r = httpx.post(cluster.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": CONTEXT},
                         {"role": "user", "content": q}]})
        assert r.status_code == 200, r.text
        time.sleep(0.5)  # the put of the context's blocks lands before the next request
    wait_no_leaks(cluster)
    n = len(QUESTIONS)
    return _wait_for(cluster, lambda d: (
        d["ready"] and d["store"] is not None and d["store"]["age_s"] < 2.0
        and d["cache"] is not None and d["admission"]["conductor"]["placed"] == n
        and len(d["requests"]) == n and all(r["transfer_bytes"] > 0 for r in d["requests"])
        and all(w["used_blocks"] == 0 for w in d["workers"])))


def test_data_matches_metrics(cluster: LocalCluster, served: dict[str, Any]) -> None:
    d = served
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
    assert d["admission"]["http"] == {"200": len(QUESTIONS)}
    assert _sum(router, "crescent_router_requests", 'status="200"') == len(QUESTIONS)
    assert d["admission"]["rejected_429"] == 0 == \
        _sum(router, "crescent_router_requests", 'status="429"')
    assert d["transfer"]["bytes"] == _sum(router, "crescent_router_kv_transfer_bytes") > 0
    assert d["transfer"]["transfers"] == len(QUESTIONS) == \
        _sum(router, "crescent_router_kv_transfer_seconds_count")
    # the conductor's
    conductor = _metrics(f"http://{cfg.host}:{cfg.port('conductor_http')}")
    cache, cond = d["cache"], d["admission"]["conductor"]
    assert cond["placed"] == _sum(conductor, "crescent_conductor_placed") == len(QUESTIONS)
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


def test_timelines(served: dict[str, Any]) -> None:
    reqs = served["requests"]
    assert [r["status"] for r in reqs] == [200] * len(QUESTIONS)
    assert reqs[0]["arrival"] > reqs[-1]["arrival"], "newest first"
    for r in reqs:
        p = r["phases"]
        assert p["prefill"] > 0 and p["decode"] > 0 and p["queued"] >= 0
        assert p["transfer"] >= 0
        assert sum(p.values()) == pytest.approx(r["ended"] - r["arrival"], abs=0.05)
        assert r["output_tokens"] == 8 and r["prompt_tokens"] > 100
        assert r["prefill_id"].startswith("prefill") and r["decode_id"].startswith("decode")
    assert any(r["cached_tokens"] > 0 for r in reqs)


def test_crescent_status(cluster: LocalCluster, served: dict[str, Any]) -> None:
    cli = [sys.executable, "-m", "launch.cli", "status", "--url", cluster.url]
    out = subprocess.run(cli, cwd=REPO, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for w in served["workers"]:  # instance, role, used, free, total, cached, ...
        row = next(line.split() for line in text.splitlines()
                   if line.split()[:1] == [w["instance_id"]])
        assert row[1:6] == [w["role"], *(f"{w[k]:,}" for k in (
            "used_blocks", "free_blocks", "total_blocks", "cached_blocks"))]
    assert re.search(rf"placed\s+{len(QUESTIONS)}\b", text)
    assert re.search(r"HTTP outcomes\s+200: 4\b", text)
    for r in served["requests"]:
        assert r["request_id"] in text
    as_json = subprocess.run(cli + ["--json"], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
    assert as_json.returncode == 0, as_json.stderr
    got = json.loads(as_json.stdout)
    assert [(w["instance_id"], w["total_blocks"]) for w in got["workers"]] == \
        [(w["instance_id"], w["total_blocks"]) for w in served["workers"]]
    assert got["admission"]["conductor"] == served["admission"]["conductor"]
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


def test_page_in_headless_chromium(cluster: LocalCluster, served: dict[str, Any],
                                   browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(cluster.url + "/dashboard")
    WebDriverWait(browser, 15).until(
        lambda b: b.find_element(By.TAG_NAME, "body").get_attribute("data-updated"))
    d = _data(cluster)
    rows = browser.find_elements(By.CSS_SELECTOR, "#workers tr[data-worker]")
    assert sorted(r.get_attribute("data-worker") for r in rows) == \
        sorted(w["instance_id"] for w in d["workers"])
    for w in d["workers"]:
        row = browser.find_element(By.CSS_SELECTOR, f'tr[data-worker="{w["instance_id"]}"]')
        for key in ("used_blocks", "free_blocks", "cached_blocks", "queued", "running",
                    "assigned"):
            shown = row.find_element(By.CSS_SELECTOR, f'td[data-k="{key}"]')
            assert shown.text == f"{w[key]:,}", (w["instance_id"], key)
    shown = {e.get_attribute("data-k"): e.text for e in
             browser.find_elements(By.CSS_SELECTOR, "#admission td[data-k]")}
    assert shown["http:200"] == str(d["admission"]["http"]["200"])
    assert shown["placed"] == str(d["admission"]["conductor"]["placed"])
    cache = d["cache"]
    assert browser.find_element(By.ID, "global_hit_rate").text == \
        f"{100 * cache['global_hit_rate']:.1f} %"
    assert browser.find_element(By.ID, "local_hit_rate").text == \
        f"{100 * cache['local_hit_rate']:.1f} %"
    timelines = browser.find_elements(By.CSS_SELECTOR, "#requests tr[data-request]")
    assert [t.get_attribute("data-request") for t in timelines] == \
        [r["request_id"] for r in d["requests"]]
    assert browser.find_element(By.ID, "health").text == "ready"
    time.sleep(2.5)  # a few refreshes: none of them may log an error
    ARTIFACTS.mkdir(exist_ok=True)
    assert browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert errors == []
    assert float(browser.find_element(By.TAG_NAME, "body").get_attribute("data-updated")) \
        > d["time"], "the page refreshes itself"
