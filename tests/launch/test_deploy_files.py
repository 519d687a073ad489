"""docker-compose.yml and the shipped configs are valid and name every role."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.config import ClusterConfig, StoreConfig
from common.config_topology import FIXED_PORTS
from common.health import health_port
from common.service import ROLES

REPO = Path(__file__).resolve().parents[2]
MONITORING = ("prometheus", "grafana")


def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_has_one_service_per_role() -> None:
    services = dict(compose()["services"])
    for other in ("keygen", *MONITORING):
        services.pop(other)
    assert set(services) == set(ROLES) - {"colocated"}  # compose runs the disaggregated shape
    for name, svc in services.items():
        assert svc["command"][0] == name
        config = svc["volumes"][0].split(":")[0]
        assert (REPO / config).is_file()
    for gpu_role in ("prefill", "decode"):
        devices = services[gpu_role]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_compose_closes_the_control_plane() -> None:
    """CURVE on by default: a one-shot keygen fills a volume every role reads, the roles
    start only after it succeeded, and the config points [security] at it."""
    doc = compose()
    keygen = doc["services"]["keygen"]
    assert keygen["entrypoint"] == ["crescent", "keygen"] and keygen["command"] == ["/keys"]
    assert keygen["volumes"] == ["crescent-keys:/keys"] and keygen["restart"] == "no"
    assert "crescent-keys" in doc["volumes"]
    for name in set(ROLES) - {"colocated"}:
        svc = doc["services"][name]
        assert "crescent-keys:/keys:ro" in svc["volumes"]
        assert svc["depends_on"]["keygen"] == {"condition": "service_completed_successfully"}
    config = ClusterConfig.load(str(REPO / "launch" / "configs" / "compose.toml"))
    assert config.security.curve_key_dir == "/keys"
    assert ClusterConfig().security.curve_key_dir is None  # `crescent up` on one host: off


def test_compose_health_checks_ask_each_roles_health_port() -> None:
    """Every role's healthcheck asks its own /health port (common/health.py); the router's
    asks its HTTP /health, which is ready only once the conductor's status is fresh."""
    doc = compose()
    config = ClusterConfig.load(str(REPO / "launch" / "configs" / "compose.toml"))
    generic = doc["x-crescent"]["healthcheck"]["test"]
    assert "HEALTH_PORT" in generic[-1] and "/health" in generic[-1]
    for role in set(ROLES) - {"colocated"}:
        svc = doc["services"][role]
        assert int(svc["environment"]["HEALTH_PORT"]) == health_port(config, role, 0)
        check = svc["healthcheck"]["test"]
        if role == "router":
            assert f"'http://127.0.0.1:{config.http_port}/health'" in check[-1]
        else:
            assert check == generic, role


def targets(service: dict) -> dict[str, str]:
    """A compose service's volumes, ``SOURCE:TARGET[:MODE]``, as {target: source}."""
    return {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}


def test_compose_monitoring_is_wired() -> None:
    """Prometheus reads the shipped scrape config and listens where Grafana's datasource
    points; Grafana loads the shipped provisioning and dashboards from where the provider
    looks; both are pinned official images on the host network, like the roles."""
    doc = compose()
    prom, grafana = (doc["services"][name] for name in MONITORING)
    assert prom["image"].startswith("prom/prometheus:v") and prom["network_mode"] == "host"
    assert grafana["image"].startswith("grafana/grafana:1") and grafana["network_mode"] == "host"
    flags = dict(f.lstrip("-").split("=", 1) for f in prom["command"])
    mounts = targets(prom)
    assert mounts[flags["config.file"]] == "./launch/prometheus/prometheus.yml"
    assert mounts[flags["storage.tsdb.path"]] in doc["volumes"]
    yaml = pytest.importorskip("yaml")
    grafana_mounts = targets(grafana)
    provisioning = REPO / grafana_mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["url"] == f"http://{flags['web.listen-address']}"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "crescent.yml").read_text())[
        "providers"]
    dashboards = REPO / grafana_mounts[provider["options"]["path"]]
    assert (dashboards / "crescent.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/crescent.json"
    assert grafana["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert flags["web.listen-address"].startswith("127.0.0.1:")


@pytest.mark.parametrize("path", sorted((REPO / "launch" / "configs").glob("*.toml")))
def test_shipped_configs_load(path: Path) -> None:
    config = ClusterConfig.load(str(path))
    assert config.prefill_workers >= 1 and config.decode_workers >= 1


def test_unknown_config_key_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('modle = "x"\n')
    with pytest.raises(ValueError, match="modle"):
        ClusterConfig.load(str(bad))


def test_inbox_ports_are_distinct() -> None:
    c = ClusterConfig(prefill_workers=3, decode_workers=2, colocated_workers=2,
                      store=StoreConfig(nodes=2))
    addrs = [c.inbox(r) for r in ("router", "conductor", "store_master")]
    addrs += [c.inbox("prefill", i) for i in range(3)] + [c.inbox("decode", i) for i in range(2)]
    addrs += [c.inbox("store_node", i) for i in range(2)]
    addrs += [c.inbox("colocated", i) for i in range(2)]
    assert len(set(addrs)) == len(addrs)
    ports = [int(a.rsplit(":", 1)[1]) for a in addrs[3:]]  # the per-instance inboxes
    ports += [c.port(name) for name in FIXED_PORTS] + [c.http_port]
    assert len(set(ports)) == len(ports)
