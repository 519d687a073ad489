"""Monitoring for docker-compose.yml: Prometheus scrapes every metrics endpoint Crescent has,
and the shipped Grafana dashboard is valid Grafana JSON whose queries name only metrics
Crescent exports (collected from the code's own registries)."""
from __future__ import annotations

import copy
import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from prometheus_client import CollectorRegistry

from common.config import ClusterConfig
from common.worker_metrics import metrics_port, worker_processes

yaml = pytest.importorskip("yaml")
promql = pytest.importorskip("promql_parser")
pytest.importorskip("grafana_foundation_sdk")
from grafana_foundation_sdk.cog import runtime  # noqa: E402
from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402
from grafana_foundation_sdk.cog.plugins import register_default_plugins  # noqa: E402
from grafana_foundation_sdk.models.dashboard import Dashboard, RowPanel  # noqa: E402

from launch.grafana import dashboard as generator  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "launch" / "grafana" / "dashboards" / "crescent.json"
WORKER_METRICS = REPO / "common" / "worker_metrics.py"
GRAFANA = REPO / "launch" / "grafana" / "provisioning"
# Sample names a metric family exposes, by type (the Prometheus text format).
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created"),
            "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}


def registries() -> dict[str, CollectorRegistry]:
    """role → the registry of every class that builds one, in every module of services/
    that uses prometheus_client (services/<role>/...), and ``worker`` → the workers' and
    store nodes' (common/worker_metrics.py): the code's own metrics."""
    found: dict[str, CollectorRegistry] = {}
    for path in sorted((REPO / "services").rglob("*.py")) + [WORKER_METRICS]:
        if "prometheus_client" not in path.read_text():
            continue
        module = importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts))
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == module.__name__):
                continue
            params = list(inspect.signature(cls).parameters.values())
            if any(p.default is p.empty for p in params):
                continue  # not a metrics holder (those take no required arguments)
            registry = getattr(cls(), "registry", None)
            if isinstance(registry, CollectorRegistry):
                found["worker" if path == WORKER_METRICS else
                      path.relative_to(REPO).parts[1]] = registry
    return found


def scrape_targets(config: ClusterConfig) -> dict[tuple[str, str], str]:
    """(role, worker label) → the address:port Prometheus must scrape: the router, the
    conductor, the store master, and every worker and store node the cluster runs."""
    ports = {("router", ""): config.http_port, ("conductor", ""): config.port("conductor_http"),
             ("store_master", ""): config.port("store_master_http")}
    targets = {key: f"{config.address(key[0])}:{port}" for key, port in ports.items()}
    for role, index in worker_processes(config):
        targets[role, config.instance_id(role, index)] = \
            f"{config.address(role, index)}:{metrics_port(config, role, index)}"
    return targets


def exported_names() -> set[str]:
    return {family.name + suffix for registry in registries().values()
            for family in registry.collect() for suffix in SUFFIXES[family.type]}


def dashboard_json() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in doc["panels"] if p["type"] != "row"]


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression selects (Grafana's $__rate_interval filled in)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql.VectorSelector):
            names.add(node.name)

    promql.walk(promql.parse(expr.replace("$__rate_interval", "1m")), visit)
    return names


def grafana_problems(doc: dict[str, Any]) -> list[str]:
    """Why ``doc`` is not a dashboard in Grafana's model (grafana-foundation-sdk, generated
    from Grafana's schema): it must decode, and encode back to itself, so a key the model
    lacks (a typo) or a shape it cannot take fails; every panel and query must be a known
    plugin's, with ids and refIds unique."""
    register_default_plugins()
    try:
        model = Dashboard.from_json(copy.deepcopy(doc))
        again = json.loads(JSONEncoder().encode(model))
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        return [f"does not decode: {exc!r}"]
    problems = [] if again == doc else ["changes in Grafana's model: unknown keys or shapes"]
    for panel in model.panels or []:
        if isinstance(panel, RowPanel):
            continue
        if runtime.panelcfg_config(panel.type_val) is None:
            problems.append(f"panel {panel.id_val}: unknown panel type {panel.type_val!r}")
        if any(isinstance(t, runtime.UnknownDataquery) for t in panel.targets or []):
            problems.append(f"panel {panel.id_val}: a query of no known datasource")
            continue
        refs = [t.ref_id for t in panel.targets or []]
        if len(set(refs)) != len(refs) or "" in refs or None in refs:
            problems.append(f"panel {panel.id_val}: refIds {refs}")
    ids = [p.id_val for p in model.panels or []]
    if len(set(ids)) != len(ids):
        problems.append(f"panel ids repeat: {ids}")
    return problems


def test_exported_names_come_from_every_service_registry() -> None:
    assert set(registries()) == {"router", "conductor", "store_master", "worker"}
    names = exported_names()
    assert {"crescent_router_time_to_first_token_seconds_bucket",
            "crescent_conductor_rejected_total", "store_used_bytes",
            "crescent_worker_kv_blocks", "crescent_worker_step_seconds_bucket",
            "crescent_worker_kv_moved_bytes_total"} <= names


def test_prometheus_scrapes_every_metrics_endpoint_of_compose() -> None:
    config = ClusterConfig.load(str(REPO / "launch" / "configs" / "compose.toml"))
    expected = scrape_targets(config)
    # each process that has metrics, and no other: the singletons, then every worker
    assert {role for role, worker in expected if not worker} | {"worker"} == set(registries())
    assert {role for role, worker in expected if worker} == {"prefill", "decode", "store_node"}
    scrape = yaml.safe_load((REPO / "launch" / "prometheus" / "prometheus.yml").read_text())
    targets = {}
    for job in scrape["scrape_configs"]:
        for static in job["static_configs"]:
            (target,) = static["targets"]
            labels = static["labels"]
            targets[labels["role"], labels.get("worker", "")] = target
        assert job.get("metrics_path", "/metrics") == "/metrics"
    assert targets == expected


def relabel(rules: list[dict[str, Any]], labels: dict[str, str]) -> Optional[dict[str, str]]:
    """Prometheus's relabelling (the keep and replace actions) of one target's labels;
    None when a rule drops it."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "")
                                                for name in rule.get("source_labels", []))
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            if match is None:
                return None
        elif match is not None:
            labels[rule["target_label"]] = re.sub(
                r"\$\{?(\d+)\}?", lambda g: match.group(int(g.group(1))) or "",
                rule.get("replacement", "$1"))
    return labels


def test_the_k8s_scrape_config_labels_every_pod_as_compose_does() -> None:
    """Every pod of launch/k8s/ that serves metrics is scraped at its annotated port with
    the `role` and `worker` labels the dashboard groups by: the targets of k8s.toml."""
    from tests.launch.test_k8s import statefulsets

    config = ClusterConfig.load(str(REPO / "launch" / "configs" / "k8s.toml"))
    scrape = yaml.safe_load((REPO / "launch" / "prometheus" / "prometheus-k8s.yml").read_text())
    (job,) = scrape["scrape_configs"]
    found, names = {}, {}
    for sts in statefulsets().values():
        template = sts["spec"]["template"]["metadata"]
        for i in range(sts["spec"]["replicas"]):
            pod = f"{sts['metadata']['name']}-{i}"
            ip = f"10.0.0.{len(names) + 1}"
            names[ip] = f"{pod}.{sts['spec']['serviceName']}"  # its headless Service name
            meta = {"__address__": ip, "__meta_kubernetes_pod_name": pod,
                    "__meta_kubernetes_pod_ip": ip}
            meta.update({"__meta_kubernetes_pod_label_" + re.sub(r"[^a-z0-9]", "_", k): v
                         for k, v in template["labels"].items()})
            meta.update({"__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-z0-9]", "_", k): v
                         for k, v in template.get("annotations", {}).items()})
            target = relabel(job["relabel_configs"], meta)
            if target is not None:
                assert target.get("__metrics_path__") == "/metrics", target
                host, port = target["__address__"].split(":")
                found[target["role"], target.get("worker", "")] = f"{names[host]}:{port}"
    assert found == scrape_targets(config)


def test_scrape_config_passes_promtool() -> None:
    """(Debian's promtool is built without Kubernetes discovery: it refuses
    prometheus-k8s.yml's kubernetes_sd_configs, which the test above checks instead.)"""
    promtool = Path(sys.prefix) / "tools" / "usr" / "bin" / "promtool"
    if not promtool.is_file():
        pytest.skip(f"no {promtool} (launch/setup.sh unpacks Debian's prometheus)")
    check = subprocess.run([promtool, "check", "config", "launch/prometheus/prometheus.yml"],
                           cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_dashboard_file_is_the_generators_output() -> None:
    assert DASHBOARD.read_text() == generator.build(), \
        "run `python -m launch.grafana.dashboard` to regenerate it"


def test_dashboard_is_valid_grafana_json() -> None:
    assert grafana_problems(dashboard_json()) == []


@pytest.mark.parametrize("break_it", [
    lambda d: d["panels"][1].update(tittle="typo"),
    lambda d: d["panels"][1].update(gridPos="1x2"),
    lambda d: d["panels"][1]["targets"][0].update(exprr="up"),
    lambda d: d["panels"][1].update(type="no-such-panel"),
    lambda d: d["panels"][2].update(id=d["panels"][1]["id"]),
    lambda d: d["panels"][1]["targets"][1].update(refId="A"),
    lambda d: d["panels"][1]["datasource"].update(type="nosuchdb")
    or [t["datasource"].update(type="nosuchdb") for t in d["panels"][1]["targets"]],
], ids=["unknown-key", "wrong-shape", "unknown-query-key", "unknown-panel", "same-id",
        "same-refid", "unknown-datasource"])
def test_an_invalid_dashboard_fails(break_it: Callable[[dict[str, Any]], Any]) -> None:
    doc = dashboard_json()
    break_it(doc)
    assert grafana_problems(doc) != []


def test_every_query_names_only_exported_metrics() -> None:
    exported = exported_names()
    used: set[str] = set()
    for panel in panels(dashboard_json()):
        for target in panel["targets"]:
            names = metric_names(target["expr"])
            assert names and names <= exported, (panel["title"], names - exported)
            used |= names
    # what the dashboard is for (issue 13): one metric of each view at least
    assert {"crescent_router_time_to_first_token_seconds_bucket",
            "crescent_router_inter_token_latency_seconds_bucket",
            "crescent_router_requests_total", "crescent_conductor_rejected_total",
            "crescent_worker_kv_blocks", "store_used_bytes", "store_policy_events_total",
            "crescent_global_cache_hit_tokens_total",
            "crescent_conductor_kv_transfer_bytes_total", "crescent_prefill_compute_seconds_sum",
            "crescent_prefill_transfer_wait_seconds_sum", "crescent_worker_step_seconds_bucket",
            "crescent_worker_step_sequences_sum", "crescent_worker_kv_moved_bytes_total",
            "crescent_worker_transfer_errors_total",
            "crescent_worker_quarantined_blocks"} <= used
    assert metric_names("rate(crescent_no_such_metric_total[$__rate_interval])") - exported


def test_queries_use_the_provisioned_datasource() -> None:
    (source,) = yaml.safe_load((GRAFANA / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    ref = {"type": source["type"], "uid": source["uid"]}
    for panel in panels(dashboard_json()):
        assert panel["datasource"] == ref
        assert all(t["datasource"] == ref for t in panel["targets"])
