"""Install packages into a virtual environment with uv, or with pip where uv cannot be
installed. The standard library only: launch/setup.sh and benchmarks/aiperf_venv.py run it
with any python3, before the environment has anything in it.

uv installs the same pins 3-4x faster than pip (a fresh clone's ``.venv`` on the 2-core
box: 98 s with pip, 28 s with uv). It reads no pip.conf, so the settings pip would use
(the index, extra indexes, find-links: the CI image's local CPU torch wheel lies there,
and PyPI's torch of the same version is the CUDA build, gigabytes; constraints; the CA
file) are passed on from pip's own configuration and environment.

    python3 launch/pip_install.py VENV/bin/python [--compile] PACKAGE-OR-OPTION...
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# pip's setting -> uv's option (one option per value; pip separates values by spaces)
PIP_SETTINGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
                "find-links": "--find-links", "constraint": "--constraint"}
# the sections of pip's configuration that its install command reads, weakest first (its
# environment variables, which win, are read from the environment)
CONFIG_SECTIONS = {"global": 0, "install": 1}
CONFIG_LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<key>[a-z-]+)='(?P<value>.*)'$")


def pip_settings(pip_config: str, environ: dict[str, str]) -> dict[str, str]:
    """The settings of ``PIP_SETTINGS`` and ``cert`` that pip would use, from the output of
    ``pip config list`` and the environment (which wins, as in pip)."""
    settings: dict[str, str] = {}
    matches = [m for m in map(CONFIG_LINE.match, pip_config.splitlines())
               if m and m["section"] in CONFIG_SECTIONS]
    for match in sorted(matches, key=lambda m: CONFIG_SECTIONS[m["section"]]):
        settings[match["key"]] = match["value"].replace("\\n", " ")  # a multi-line value
    for key in (*PIP_SETTINGS, "cert"):
        value = environ.get("PIP_" + key.upper().replace("-", "_"))
        if value:
            settings[key] = value
    return settings


def uv_options(settings: dict[str, str]) -> list[str]:
    """uv's options for pip's ``settings``."""
    options: list[str] = []
    for key, option in PIP_SETTINGS.items():
        for value in settings.get(key, "").split():
            options += [option, value]
    return options


def installer(python: str) -> tuple[list[str], dict[str, str]]:
    """The install command for the environment of ``python``, and its environment: uv,
    installed there first, or that environment's pip where uv cannot be installed."""
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    uv = Path(python).parent / "uv"
    if not uv.is_file() and subprocess.run([*pip, "uv"], check=False, timeout=600,
                                           stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL).returncode != 0:
        print("pip_install: uv could not be installed; using pip", file=sys.stderr)
        return pip, dict(os.environ)
    config = subprocess.run([python, "-m", "pip", "config", "list"], check=False,
                            timeout=120, capture_output=True, text=True).stdout
    settings = pip_settings(config, dict(os.environ))
    environ = dict(os.environ)
    if settings.get("cert"):
        environ.setdefault("SSL_CERT_FILE", settings["cert"])
    # pip takes the best version from all indexes; uv, by default, only the first index's
    return [str(uv), "pip", "install", "-q", "--python", python,
            "--index-strategy", "unsafe-best-match", *uv_options(settings)], environ


def install(python: str, args: list[str], compile_bytecode: bool = False,
            timeout: float = 1800) -> None:
    """Install ``args`` (packages and install options) into ``python``'s environment;
    with ``compile_bytecode`` uv compiles every module there afterwards, as pip compiles
    what it installs (otherwise the suite's first processes, started together, would each
    compile torch's modules).
    Raises ``subprocess.CalledProcessError`` when the install fails."""
    command, environ = installer(python)
    if compile_bytecode and command[0] != python:
        command.append("--compile-bytecode")
    subprocess.run([*command, *args], check=True, env=environ, timeout=timeout)


if __name__ == "__main__":
    arguments = sys.argv[2:]
    compile_all = "--compile" in arguments
    try:
        install(sys.argv[1], [a for a in arguments if a != "--compile"], compile_all)
    except subprocess.CalledProcessError as exc:
        sys.exit(exc.returncode)
