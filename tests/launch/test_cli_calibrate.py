"""``crescent calibrate``: each compute role measured again in its own pinned process, the
cached fits replaced (common/engine/calibrate.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def calibrate(cache: Path, *settings: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CRESCENT_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "launch.cli", "calibrate", "--set", "model=dummy-tiny"]
    for item in settings:
        command += ["--set", item]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_calibrate_fits_prefill_and_decode_pinned_as_up_pins_them(tmp_path: Path) -> None:
    done = calibrate(tmp_path)
    assert done.returncode == 0, done.stderr
    fits = {json.loads(line)["role"]: json.loads(line) for line in done.stdout.splitlines()
            if line.startswith("{")}
    assert fits["prefill"]["prefill"]["c_new"] >= 0 and fits["prefill"]["decode"] is None
    assert fits["decode"]["decode"]["d0"] >= 0 and fits["decode"]["prefill"] is None
    files = {p.name.split("-")[0]: p for p in (tmp_path / "profiles").glob("*.json")}
    assert set(files) == {"prefill", "decode"}
    keys = {phase: json.loads(p.read_text())["key"] for phase, p in files.items()}
    assert keys["prefill"]["model"] == "dummy-tiny"
    cores = len(os.sched_getaffinity(0))
    if cores >= 2:  # each role on its share of the cores, not all of them
        assert keys["prefill"]["threads"] + keys["decode"]["threads"] <= cores
    before = files["prefill"].stat().st_mtime_ns
    again = calibrate(tmp_path)  # measured again, not read from the cache
    assert again.returncode == 0, again.stderr
    assert files["prefill"].stat().st_mtime_ns > before


def test_a_colocated_config_calibrates_both_phases_in_one_role(tmp_path: Path) -> None:
    done = calibrate(tmp_path, "mode=colocated")
    assert done.returncode == 0, done.stderr
    [fit] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert fit["role"] == "colocated" and fit["prefill"] and fit["decode"]


def test_a_bad_setting_is_refused(tmp_path: Path) -> None:
    done = calibrate(tmp_path, "no_such_key=1")
    assert done.returncode == 2 and "no_such_key" in done.stderr
