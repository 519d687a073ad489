"""The one bootstrap: every role's ``python -m services.<role>`` goes through it."""
from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import ClusterConfig
from common.service import ROLES, parse_overrides

REPO = Path(__file__).resolve().parents[2]


def test_the_roles_are_the_services() -> None:
    packages = {p.parent.name for p in (REPO / "services").glob("*/__main__.py")}
    assert packages == set(ROLES) == {"router", "conductor", "prefill", "decode", "colocated",
                                      "store_master", "store_node"}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_main_module_is_only_the_bootstrap(role: str) -> None:
    tree = ast.parse((REPO / "services" / role / "__main__.py").read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    names = [c.func.id if isinstance(c.func, ast.Name) else ast.unparse(c.func) for c in calls]
    assert names == ["sys.exit", "bootstrap"]
    assert [ast.literal_eval(a) for a in calls[1].args] == [role]
    # and the package itself defines no entry point of its own
    package = ast.parse((REPO / "services" / role / "__init__.py").read_text())
    assert not [n for n in package.body if isinstance(n, (ast.FunctionDef, ast.Import,
                                                          ast.ImportFrom))]


@pytest.mark.parametrize("role", sorted(ROLES))
def test_run_takes_the_config_and_index(role: str) -> None:
    run = importlib.import_module(ROLES[role].module).run
    assert inspect.iscoroutinefunction(run)
    assert list(inspect.signature(run).parameters) == ["config", "index"]


def test_every_role_rejects_a_bad_config_the_same_way() -> None:
    procs = {role: subprocess.Popen([sys.executable, "-m", f"services.{role}", "--set",
                                     "store.nodez=2"], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for role in ROLES}
    for role, proc in procs.items():
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, (role, out)
        assert f"{role}-0 ERROR crescent.service: bad config: unknown config keys in " \
               f"[store]: ['nodez']" in out, (role, out)


def test_overrides_are_toml_values_in_dotted_tables() -> None:
    assert parse_overrides(["http_port=8001", "store.policy.lease_s=2.5",
                            "store.enabled=false", 'host="10.0.0.2"', "model=smollm2-135m",
                            "store.shm_dir=''"]) == {
        "http_port": 8001, "host": "10.0.0.2", "model": "smollm2-135m",
        "store": {"policy": {"lease_s": 2.5}, "enabled": False, "shm_dir": ""}}
    for bad in ("http_port", "=3", "a.=1"):
        with pytest.raises(ValueError, match="--set"):
            parse_overrides([bad])


def test_overrides_lay_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("base_port = 9000\n[store]\nnodes = 2\n[store.policy]\nlease_s = 1.0\n")
    c = ClusterConfig.load(str(path), parse_overrides(["store.policy.max_replicas=3"]))
    assert (c.base_port, c.store.nodes, c.store.policy.lease_s, c.store.policy.max_replicas) \
        == (9000, 2, 1.0, 3)
    assert c.inbox("store_master") == "tcp://127.0.0.1:9002"
    assert c.inbox("store_node", 1) == "tcp://127.0.0.1:9013"  # after 1 prefill + 1 decode


def test_a_moved_key_names_its_new_place() -> None:
    with pytest.raises(ValueError, match=r"use_store is now store\.enabled"):
        ClusterConfig.from_dict({"use_store": False})


def test_store_node_without_master_exits_1_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "services.store_node", "--set", "base_port=1",
                           "--set", "store.register_deadline_s=0.5", "--set",
                           "store.shm_dir=''", "--set", "store.segment_bytes=65536"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "store_node-0 could not start: master tcp://127.0.0.1:3 unreachable" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_signal_stops_a_service_cleanly() -> None:
    """SIGTERM → exit 0 (the conductor: no model to load, starts in a second)."""
    proc = subprocess.Popen([sys.executable, "-m", "services.conductor", "--set",
                             "base_port=23500", "--set", "store.enabled=false"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "conductor ready" in line:
                break
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
