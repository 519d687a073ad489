"""AIPerf in a virtual environment of its own (``.venv-bench``: its pins conflict with
Crescent's), found or installed once. The standard library only: ``make test`` installs it
with the system's python3 while Crescent's own environment installs (Makefile
``setup-bench``, beside ``setup``). benchmarks/live_replay.py and its e2e test use it.

    python3 benchmarks/aiperf_venv.py    # install unless present; exit 1 if it cannot
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script
    sys.path.insert(0, str(REPO))
from launch.pip_install import install as install_packages  # noqa: E402  (stdlib only)
BENCH_VENV = REPO / ".venv-bench"
AIPERF_SPEC = "aiperf==0.13.0"
INSTALL_HINT = (f"python -m venv .venv-bench && .venv-bench/bin/pip install '{AIPERF_SPEC}' (or "
                "`pip install -e .[bench]` alone: aiperf pins older pyzmq/orjson than Crescent)")


def find_aiperf(explicit: Optional[str] = None, install: bool = False) -> Optional[Path]:
    """The aiperf CLI: ``explicit``, .venv-bench's, or this interpreter's; with
    ``install``, .venv-bench is created and aiperf installed there when none exists."""
    candidates = [Path(explicit)] if explicit else [
        BENCH_VENV / "bin" / "aiperf", Path(sys.executable).parent / "aiperf"]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    if explicit or not install:
        return None
    print(f"aiperf not found; installing {AIPERF_SPEC} into {BENCH_VENV} (one time; its "
          "pins conflict with Crescent's, so it gets a venv of its own)", file=sys.stderr)
    try:
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True,
                       timeout=300)
        # uncompiled: its modules compile when a run first imports them (~5 s)
        install_packages(str(BENCH_VENV / "bin" / "python"), [AIPERF_SPEC], timeout=1200)
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"installing aiperf failed ({exc}); install it by hand: {INSTALL_HINT}",
              file=sys.stderr)
        return None
    return find_aiperf(str(BENCH_VENV / "bin" / "aiperf"))


if __name__ == "__main__":
    sys.exit(0 if find_aiperf(install=True) is not None else 1)
