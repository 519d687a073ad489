"""docker-compose.yml and the shipped configs are valid and name every role."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.config import FIXED_PORTS, ClusterConfig, StoreConfig
from common.service import ROLES

REPO = Path(__file__).resolve().parents[2]


def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


def test_compose_has_one_service_per_role() -> None:
    services = dict(compose()["services"])
    services.pop("keygen")
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
