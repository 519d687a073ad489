"""A real Prometheus (Debian's, unpacked by launch/setup.sh) scrapes a real cluster through
the shipped scrape config's jobs, and every query of the shipped dashboard runs on it and
shows data; every process of that cluster answers its /health port, and every worker and
store node is scraped on its own /metrics port."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.health import health_port, layout
from launch.cluster import LocalCluster
from tests.e2e.conftest import start_cluster
from tests.launch.test_monitoring import dashboard_json, panels, scrape_targets

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(sys.prefix) / "tools" / "usr" / "bin"
HTTP, BASE, HEALTH, PROMETHEUS, METRICS = 21800, 21810, 21830, 21840, 21850  # its ports
# empty in a healthy run: nothing was refused, no copy failed
QUIET = {"Rejected: 429s", "Transfer errors per worker"}

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    not (TOOLS / "prometheus").is_file(),
    reason=f"no prometheus in {TOOLS} (launch/setup.sh unpacks Debian's)")]


def scrape_config(cluster: LocalCluster, path: Path) -> Path:
    """The shipped config's jobs, each aimed at this cluster's process of its role."""
    targets = scrape_targets(cluster.config)
    doc = yaml.safe_load((REPO / "launch" / "prometheus" / "prometheus.yml").read_text())
    doc["global"]["scrape_interval"] = "1s"
    for job in doc["scrape_configs"]:
        for static in job["static_configs"]:
            labels = static["labels"]
            static["targets"] = [targets.pop((labels["role"], labels.get("worker", "")))]
    assert not targets, f"no job scrapes {sorted(targets)}"
    path.write_text(yaml.safe_dump(doc))
    subprocess.run([TOOLS / "promtool", "check", "config", path], check=True,
                   capture_output=True)
    return path


def query(expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"http://127.0.0.1:{PROMETHEUS}/api/v1/query", timeout=10,
                       params={"query": expr.replace("$__rate_interval", "1m")}).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def wait_for(check: Any, what: str, timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_prometheus_scrapes_a_cluster_and_every_dashboard_panel_shows_data(
        tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path, http=HTTP, base=BASE,
                            extra=f"health_port = {HEALTH}\nmetrics_port = {METRICS}")
    prometheus = None
    try:
        for role, index in layout(cluster.config):  # every process answers /health
            if role != "colocated":
                url = f"http://127.0.0.1:{health_port(cluster.config, role, index)}/health"
                assert httpx.get(url, timeout=5).json()["role"] == role
        for n in range(4):  # a shared prefix: the second and later prompts reuse KV
            httpx.post(cluster.url + "/v1/completions", timeout=120, json={
                "model": cluster.config.model_name, "max_tokens": 8,
                "prompt": "The history of the city begins " * 20 + str(n)}).raise_for_status()
        config = scrape_config(cluster, tmp_path / "prometheus.yml")
        log = (tmp_path / "prometheus.log").open("w")
        prometheus = subprocess.Popen(
            [TOOLS / "prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{PROMETHEUS}"], stdout=log, stderr=log)
        wait_for(lambda: len([r for r in _up() if r["value"][1] == "1"]) == 6,
                 "all six targets up")
        # each target is scraped on its own schedule, and a rate needs two scrapes of it
        # after the requests: wait until every panel has data (or time runs out)
        def empty() -> set[str]:
            return {p["title"] for p in panels(dashboard_json())
                    if not any(query(t["expr"]) for t in p["targets"])}
        try:
            wait_for(lambda: empty() <= QUIET, "every panel's data")
        except AssertionError:
            pass  # say which panels below
        assert empty() <= QUIET, empty()
    finally:
        if prometheus is not None:
            prometheus.terminate()
            prometheus.wait(timeout=20)
        cluster.stop()


def _up() -> list[dict[str, Any]]:
    try:  # while its storage opens, Prometheus answers 503 "Service Unavailable" in plain text
        if httpx.get(f"http://127.0.0.1:{PROMETHEUS}/-/ready", timeout=5).status_code != 200:
            return []
        return query("up")
    except httpx.TransportError:
        return []  # not listening yet
