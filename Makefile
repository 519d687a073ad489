VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= launch/configs/default.toml

.PHONY: setup setup-bench up test test-fast bench gpu-carry clean

setup:
	@bash launch/setup.sh

up: setup  ## set up, then run the local cluster with the default model
	$(VENV)/bin/crescent up $(if $(CONFIG),--config $(CONFIG),)

# AIPerf in a venv of its own (its pins conflict with ours): the live replay benchmark and
# its short e2e test use it. Not fatal: without it that one test skips and says so. Its
# installer needs only the standard library, so `make test` runs it beside `setup`. Both
# install with uv (launch/pip_install.py): on the 2-core box a fresh clone's two took 37 s
# at once, against 110 s with pip (aiperf's modules compile at its first run).
setup-bench:
	@$${PYTHON:-python3} benchmarks/aiperf_venv.py \
		|| echo "setup: aiperf unavailable; tests/e2e/test_live_replay.py will skip"

# The suite runs on TEST_WORKERS pytest-xdist workers (0: one process). A module, or the
# set of e2e modules sharing one cluster a shape, runs whole on one worker (tests/conftest.py),
# and shared clusters stop when their set ends. On the 2-core, 24 GiB CI box 2 workers
# left the cores 12-15 % idle (a worker waiting on a restart, a timeout, a socket); 3
# keep them busy, at 13.1 GiB used at the peak: a fresh clone's pytest took 586 s against
# 715 s on 2 (2026-11-28, this box).
# `make test-fast` boots no cluster: 3 workers as well (their tests wait on subprocesses
# and sockets).
# PYTHONDONTWRITEBYTECODE (set on the CI image) would make every process compile this
# repository's modules again, and pytest rewrite every test module's asserts again in each
# worker: 13.6 -> 7 CPU-s a collection, 0.3 s a service started with exec.
TEST_WORKERS ?= 3
FAST_WORKERS ?= 3
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -ra --durations=20

test:  ## set up (both environments at once), then run the whole test suite
	@$(MAKE) --no-print-directory -j2 setup setup-bench
	$(PYTEST) -n $(TEST_WORKERS)

test-fast: setup
	$(PYTEST) -n $(FAST_WORKERS) -m "not e2e"

bench: setup
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/store.py
	$(PY) benchmarks/serving_overhead.py
	$(PY) benchmarks/simulate_paper.py
	$(PY) benchmarks/kv_path.py
	$(PY) benchmarks/live_replay.py
	$(PY) benchmarks/faults.py
	$(PY) benchmarks/soak.py

# What benchmarks/gpu_device.sh installs on a GPU machine that has no network (Python 3.12,
# CUDA 13): wheels in .whl/ and Debian libraries in .deb/, both ignored by git.
GPU_WHEELS := mooncake-transfer-engine-cuda13==0.3.14 pyzmq==27.3.0 orjson==3.13.0 \
	xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5 \
	annotated-types==0.8.0 typing-inspection==0.4.5
GPU_DEBS := libibverbs1 ibverbs-providers libnuma1 librdmacm1 libcurl4 libnghttp2-14 \
	libssh2-1 librtmp1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2
gpu-carry: setup
	mkdir -p .whl .deb
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp $(foreach m,17 24 26 27 28,--platform manylinux_2_$(m)_x86_64) \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	cd .deb && apt-get download $(GPU_DEBS)

clean:
	rm -rf $(VENV) .pytest_cache
