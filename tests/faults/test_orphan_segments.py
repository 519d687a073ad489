"""The fault harness's orphan check: a segment file counts only when its owner pid is one
of the cluster's and that process is dead (no cluster: a tmp dir as the store's)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from benchmarks.faults import orphan_segments


def test_only_files_of_dead_cluster_processes_are_orphans(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = os.getpid()
    names = {f"crescent-store-h-store_node-0-{dead.pid}": True,  # ours, dead: orphan
             f"crescent-store-h-store_node-1-{alive}": False,  # ours, running
             f"crescent-store-h-store_node-2-{dead.pid + 1}": False,  # not ours
             f"other-{dead.pid}": False}  # not a segment
    for name in names:
        (tmp_path / name).write_bytes(b"")
    cluster = SimpleNamespace(config=SimpleNamespace(store=SimpleNamespace(
        shm_dir=str(tmp_path))))
    found = orphan_segments(cluster, {dead.pid, alive})  # type: ignore[arg-type]
    assert [Path(p).name for p in found if Path(p).parent == tmp_path] == [
        n for n, orphan in names.items() if orphan]
