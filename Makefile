VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= launch/configs/default.toml

.PHONY: setup setup-bench up test test-fast bench clean

setup:
	@bash launch/setup.sh

up: setup  ## set up, then run the local cluster with the default model
	$(VENV)/bin/crescent up $(if $(CONFIG),--config $(CONFIG),)

# AIPerf in a venv of its own (its pins conflict with ours): the live replay benchmark and
# its short e2e test use it. Not fatal: without it that one test skips and says so.
setup-bench: setup
	@$(PY) -c "import sys; from benchmarks.live_replay import find_aiperf; sys.exit(find_aiperf(install=True) is None)" \
		|| echo "setup: aiperf unavailable; tests/e2e/test_live_replay.py will skip"

test: setup setup-bench  ## set up, then run the whole test suite
	$(PY) -m pytest -q -ra

test-fast: setup
	$(PY) -m pytest -q -ra -m "not e2e"

bench: setup
	$(PY) benchmarks/engine.py
	$(PY) benchmarks/store.py
	$(PY) benchmarks/serving_overhead.py
	$(PY) benchmarks/simulate_paper.py
	$(PY) benchmarks/kv_path.py
	$(PY) benchmarks/live_replay.py
	$(PY) benchmarks/faults.py
	$(PY) benchmarks/soak.py

clean:
	rm -rf $(VENV) .pytest_cache
