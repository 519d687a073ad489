"""launch/k8s/: valid Kubernetes objects (the API's own schemas, offline), and a cluster that
agrees with launch/configs/k8s.toml: one StatefulSet per role, a pod per process at the
address the config gives it, real `crescent serve` arguments, the config's ports, probes on
paths that exist, GPUs for workers, CURVE keys from a Secret."""
from __future__ import annotations

import copy
import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from common import health
from common.config import INDEXED_ROLES, ClusterConfig
from common.security import key_paths
from common.service import ROLES, parse_args
from common.worker_metrics import metrics_port
from services.router.handlers import routes

kv = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "launch" / "k8s"
TOML = REPO / "launch" / "configs" / "k8s.toml"
# 1.28: the first release with the apps.kubernetes.io/pod-index label (--index from it).
VERSIONS = ("1.28.0", kv.utils.latest_version())
GPU_ROLES = {"prefill", "decode"}


def manifests() -> list[dict[str, Any]]:
    return [doc for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def config() -> ClusterConfig:
    return ClusterConfig.load(str(TOML))


def statefulsets() -> dict[str, dict[str, Any]]:
    """role → its StatefulSet (the pod label app.kubernetes.io/component names the role)."""
    by_component = {s["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]:
                    s for s in objects("StatefulSet").values()}
    return {role: by_component[role.replace("_", "-")] for role in ROLES
            if role.replace("_", "-") in by_component}


def container(sts: dict[str, Any]) -> dict[str, Any]:
    (only,) = sts["spec"]["template"]["spec"]["containers"]
    return only


def volume_of(sts: dict[str, Any], mount_path: str) -> dict[str, Any]:
    (mount,) = [m for m in container(sts)["volumeMounts"] if m["mountPath"] == mount_path]
    (volume,) = [v for v in sts["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    return {**volume, "readOnly": mount.get("readOnly", False)}


def quantity_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", text).groups()
    return int(number) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[unit]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(version: str) -> None:
    docs = manifests()
    assert {d["kind"] for d in docs} == {"ConfigMap", "Service", "StatefulSet"}
    for doc in docs:
        kv.validate(doc, version, strict=True)  # raises on any unknown or mistyped field


def test_the_validator_rejects_a_broken_manifest() -> None:
    sts = copy.deepcopy(statefulsets()["decode"])
    container(sts)["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kv.ValidationError, match="paht"):
        kv.validate(sts, VERSIONS[0], strict=True)
    sts = copy.deepcopy(statefulsets()["decode"])
    sts["spec"]["replicas"] = "one"
    with pytest.raises(kv.ValidationError, match="one"):
        kv.validate(sts, VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_configmap_is_the_cluster_toml_verbatim() -> None:
    (cm,) = objects("ConfigMap").values()
    text = cm["data"]["crescent.toml"]
    assert text == TOML.read_text()
    loaded = ClusterConfig.from_dict(tomllib.loads(text))
    assert loaded == config() and loaded.bind_host == "0.0.0.0"


def test_one_statefulset_per_role_a_pod_per_process_at_its_configured_address() -> None:
    c, sets = config(), statefulsets()
    assert set(sets) == set(ROLES) - {"colocated"}  # Kubernetes runs the disaggregated shape
    assert c.mode == "disaggregated"
    services = objects("Service")
    for role, sts in sets.items():
        spec = sts["spec"]
        assert spec["replicas"] == c.processes(role), role
        svc = services[spec["serviceName"]]["spec"]
        assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
        assert svc["selector"] == spec["selector"]["matchLabels"] \
            == spec["template"]["metadata"]["labels"]
        pods = [f"{sts['metadata']['name']}-{i}.{spec['serviceName']}"
                for i in range(spec["replicas"])]
        assert [c.address(role, i) for i in range(spec["replicas"])] == pods


def test_containers_run_crescent_serve_with_the_mounted_config() -> None:
    """No command: the image's ENTRYPOINT (`crescent serve`) runs the role with args that
    the bootstrap's own parser accepts, --index from the pod's ordinal."""
    entrypoint = re.search(r"^ENTRYPOINT (.+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert json.loads(entrypoint.group(1)) == ["crescent", "serve"]
    for role, sts in statefulsets().items():
        box = container(sts)
        assert "command" not in box and box["args"][0] == role
        env = {e["name"]: e for e in box.get("env", [])}
        args = [a.replace("$(POD_INDEX)", "3") for a in box["args"][1:]]
        parsed = parse_args(role, args)
        if sts["spec"]["replicas"] > 1 or role not in ("conductor", "store_master"):
            assert parsed.index == 3 and env["POD_INDEX"]["valueFrom"]["fieldRef"] == {
                "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
        else:
            assert parsed.index == 0 and "POD_INDEX" not in env
        directory, name = parsed.config.rsplit("/", 1)
        volume = volume_of(sts, directory)
        assert volume["configMap"]["name"] in objects("ConfigMap") and volume["readOnly"]
        assert name == "crescent.toml"


def test_ports_are_the_configs() -> None:
    c = config()
    fixed = {"router": {"http": c.http_port, "inbox": c.port("router")},
             "conductor": {"inbox": c.port("conductor"), "metrics": c.port("conductor_http")},
             "store_master": {"inbox": c.port("store_master"),
                              "metrics": c.port("store_master_http"),
                              "events": c.port("store_events")}}
    services = objects("Service")
    for role, sts in statefulsets().items():
        ports = {p["name"]: p["containerPort"] for p in container(sts)["ports"]}
        health_ports = {health.health_port(c, role, i) for i in range(c.processes(role))}
        assert health_ports == {ports.pop("health")}  # one probe port fits every pod
        if role in INDEXED_ROLES:  # a worker's own /metrics: one port fits every pod too
            assert {metrics_port(c, role, i) for i in range(c.processes(role))} == {
                ports.pop("metrics")}
        assert ports == fixed.get(role, {}), role
        service_ports = {p["name"]: p["port"] for p in
                         services[sts["spec"]["serviceName"]]["spec"]["ports"]}
        assert service_ports.items() <= {**ports, "health": health_ports.pop()}.items()


def test_readiness_probes_hit_paths_that_exist() -> None:
    router_paths = {r.path for r in routes() if r.method == "GET"}
    for role, sts in statefulsets().items():
        box = container(sts)
        probe = box["readinessProbe"]["httpGet"]
        if role == "router":  # its own /health: ready once the conductor's status is fresh
            assert probe["port"] == "http" and probe["path"] in router_paths
        else:
            assert (probe["port"], probe["path"]) == ("health", health.PATH)
        assert probe["port"] in {p["name"] for p in box["ports"]}
    annotations = {role: sts["spec"]["template"]["metadata"].get("annotations", {})
                   for role, sts in statefulsets().items()}
    scraped = {role: int(a["prometheus.io/port"]) for role, a in annotations.items()
               if a.get("prometheus.io/scrape") == "true"}
    c = config()
    assert scraped == {"router": c.http_port, "conductor": c.port("conductor_http"),
                       "store_master": c.port("store_master_http"), "prefill": c.metrics_port,
                       "decode": c.metrics_port, "store_node": c.metrics_port}


def test_gpus_for_workers_only() -> None:
    for role, sts in statefulsets().items():
        limits = container(sts)["resources"].get("limits", {})
        assert (int(limits.get("nvidia.com/gpu", 0)) >= 1) == (role in GPU_ROLES), role


def test_curve_keys_come_from_a_secret() -> None:
    c = config()
    public, secret = key_paths(c.security.curve_key_dir)
    assert public.parent == secret.parent == Path(c.security.curve_key_dir)
    for role, sts in statefulsets().items():
        keys = volume_of(sts, c.security.curve_key_dir)
        assert keys["secret"]["secretName"] == "crescent-keys" and keys["readOnly"]
        assert keys["secret"]["defaultMode"] & 0o077 == 0  # load_keys warns otherwise
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert f"kubectl create secret generic crescent-keys --from-file={public.name}=" in docs
    assert f"--from-file={secret.name}=" in docs


def test_a_workers_cache_outlives_its_container() -> None:
    """A worker's first start on a machine fits its cost profile (seconds, on a GPU
    minutes of kernels and weights); a restarted container starts from the image, so the
    cache directory is a pod's emptyDir, kept across container restarts."""
    for role in ("prefill", "decode"):
        sts = statefulsets()[role]
        env = {e["name"]: e.get("value") for e in container(sts)["env"]}
        cache = volume_of(sts, env["CRESCENT_CACHE_DIR"])
        assert cache["emptyDir"] == {} and not cache["readOnly"], role


def test_shared_memory_fits_the_store_segment_and_nothing_persists() -> None:
    """A pod's /dev/shm is 64 MiB unless mounted: the store node's segment lives there.
    No PersistentVolumeClaim: the store master keeps its metadata in memory (a restart is
    a new incarnation) and a store node's SSD tier starts empty on every start."""
    c, sets = config(), statefulsets()
    shm = volume_of(sets["store_node"], "/dev/shm")["emptyDir"]
    assert c.store.shm_dir == "/dev/shm" and shm["medium"] == "Memory"
    assert quantity_bytes(shm["sizeLimit"]) >= c.store.segment_bytes
    assert c.store.ssd_bytes == 0
    assert not any("volumeClaimTemplates" in s["spec"] for s in sets.values())
    assert "PersistentVolumeClaim" not in {d["kind"] for d in manifests()}
