VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= launch/configs/default.toml

.PHONY: setup up test test-fast bench clean

setup:
	@bash launch/setup.sh

up: setup  ## set up, then run the local cluster with the default model
	$(VENV)/bin/crescent up $(if $(CONFIG),--config $(CONFIG),)

test: setup  ## set up, then run the whole test suite
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

clean:
	rm -rf $(VENV) .pytest_cache
