# `make demo` and `make test` work on a fresh machine: they build .venv/ when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned to the CPU wheel that lies on disk: a looser pin downloads gigabytes.
TORCH := torch==2.13.0

.PHONY: demo test bench lint clean

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base pyproject.toml
	$(PIP) install -q $(TORCH) -e '.[test]'
	$(PIP) install -q --no-build-isolation $(TORCH) deepspeed==0.19.8
	touch $@

demo: $(VENV)/.base
	$(VENV)/bin/zerospeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/zero2.json

test: $(VENV)/.test
	$(PY) -m pytest -q tests

bench: $(VENV)/.test
	$(PY) benchmarks/run.py

lint: $(VENV)/.test
	$(PIP) install -q ruff
	$(VENV)/bin/ruff check zerospeed tests examples benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
