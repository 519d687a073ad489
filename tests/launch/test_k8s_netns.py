"""The Kubernetes manifests run, without Kubernetes: each pod of launch/k8s/ becomes a network
namespace of a test bed (launch/netns.py) whose /etc/hosts resolves every pod's DNS name the
way a headless Service does; each runs its container's args from the manifest with the
ConfigMap's TOML (CPU instead of CUDA) and a Secret-like key directory. Every readiness
probe of the manifests must pass, and a completion must come back through the router."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from common.security import generate_keys
from launch.netns import TestBed, available
from tests.launch.test_k8s import container, objects, statefulsets
from tests.multihost.conftest import kv_bytes

OK, WHY = available()
PREFIX, SUBNET = "ck8s", "10.79.13"
# the shipped CPU profile instead of "auto": the pods do not calibrate at their first start
# here (14 CPU-s on a fresh machine; tests/e2e/test_live_replay.py covers "auto")
CPU = ["--set", 'device="cpu"', "--set", 'dtype="float32"',
       "--set", "heartbeat_interval_s=0.2", "--set", 'cost_profile="cpu-smollm2-135m"']
CONFIG_DIR = "/etc/crescent"  # where the pods mount the ConfigMap

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not OK, reason=f"no test bed: {WHY}")]


def pods() -> list[tuple[str, int, dict[str, Any]]]:
    """(pod name, ordinal, its StatefulSet) of every pod the manifests make."""
    return [(f"{sts['metadata']['name']}-{i}", i, sts) for sts in statefulsets().values()
            for i in range(sts["spec"]["replicas"])]


def dns_names() -> dict[str, str]:
    """pod name → the name its headless Service gives it."""
    return {name: f"{name}.{sts['spec']['serviceName']}" for name, _, sts in pods()}


@pytest.fixture
def bed() -> Iterator[TestBed]:
    with TestBed(len(pods()), PREFIX, SUBNET) as made:
        yield made


def args_of(sts: dict[str, Any], ordinal: int, tmp: Path) -> list[str]:
    """The container's args as Kubernetes runs them: $(POD_INDEX) is the ordinal, and the
    ConfigMap's mount is a directory here."""
    return [a.replace("$(POD_INDEX)", str(ordinal)).replace(CONFIG_DIR, str(tmp / "config"))
            for a in container(sts)["args"]]


def probe_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def wait_kv_bytes(bed: TestBed, host: str, url: str) -> dict[str, float]:
    """KV bytes prefill → decode by path, from the conductor's metrics (heartbeats carry
    them: wait until some arrived)."""
    deadline = time.monotonic() + 10
    while True:
        moved = {path: n for (_, flow, path), n in
                 kv_bytes(bed.call(host, httpx.get, url, timeout=5).text).items()
                 if flow == "decode"}
        if moved or time.monotonic() > deadline:
            return moved
        time.sleep(0.2)


def test_the_manifests_pods_serve_a_completion(bed: TestBed, tmp_path: Path) -> None:
    (cm,) = objects("ConfigMap").values()
    (tmp_path / "config").mkdir()
    for key, text in cm["data"].items():
        (tmp_path / "config" / key).write_text(text)
    keys = tmp_path / "keys"
    generate_keys(str(keys))
    placed = dict(zip((name for name, _, _ in pods()), bed.addresses, strict=True))
    hosts = "".join(f"{bed.addresses[placed[pod]]} {dns}\n" for pod, dns in dns_names().items())
    etc = [Path("/etc/netns") / bed.netns(host) for host in placed.values()]
    procs: list[subprocess.Popen] = []
    try:
        for directory in etc:  # `ip netns exec` mounts these over /etc/hosts
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "hosts").write_text("127.0.0.1 localhost\n" + hosts)
        for name, ordinal, sts in pods():
            argv = [sys.executable, "-m", "launch.cli", "serve", *args_of(sts, ordinal, tmp_path),
                    *CPU, "--set", f'security.curve_key_dir="{keys}"']
            log = (tmp_path / f"{name}.log").open("w")
            procs.append(bed.popen(placed[name], argv, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        for name, _, sts in pods():
            box = container(sts)
            probe = box["readinessProbe"]["httpGet"]
            port = {p["name"]: p["containerPort"] for p in box["ports"]}[probe["port"]]
            url = f"http://{bed.addresses[placed[name]]}:{port}{probe['path']}"
            while not bed.call(placed[name], probe_ok, url):
                assert time.monotonic() < deadline, f"{name} never ready:\n" + \
                    (tmp_path / f"{name}.log").read_text()[-3000:]
                time.sleep(0.5)
        router = next(name for name, _, sts in pods() if container(sts)["args"][0] == "router")
        answer = bed.call(placed[router], httpx.post,  # (this process has no pod names)
                          f"http://{bed.addresses[placed[router]]}:8000/v1/completions",
                          timeout=120,
                          json={"model": "smollm2-135m", "prompt": "The capital of France is",
                                "max_tokens": 8, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        conductor = next(n for n, _, sts in pods() if container(sts)["args"][0] == "conductor")
        scrape = statefulsets()["conductor"]["spec"]["template"]["metadata"]["annotations"]
        metrics = f"http://{bed.addresses[placed[conductor]]}:{scrape['prometheus.io/port']}" \
            f"{scrape['prometheus.io/path']}"
        moved = wait_kv_bytes(bed, placed[conductor], metrics)
        assert moved["transfer_engine"] > 0 and moved.get("shm", 0) == 0  # pods share no memory
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for directory in etc:
            shutil.rmtree(directory, ignore_errors=True)
