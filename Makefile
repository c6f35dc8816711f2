# The two commands that matter: `make reproduce` and `make test`.
# TORCH is the pinned build installed first (the local CPU wheel on our machines);
# override it on a GPU box, e.g. `make test TORCH=torch==2.14.1`.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.normlab-installed
PROFILE ?= quick
# extra flags for run_all.py, e.g. `make bench BENCH_ARGS="--device cuda --threads 2"`
BENCH_ARGS ?=

.PHONY: setup test test-slow reproduce lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

reproduce: $(STAMP)
	$(VENV)/bin/normlab reproduce --profile $(PROFILE) --out results/$(PROFILE)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
