# `make demo` and `make test` work on a fresh machine: they build .venv/ when missing.
PYTHON ?= python3
VENV := .venv
TESTS ?= tests
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned to the CPU wheel that lies on disk: a looser pin downloads gigabytes.
TORCH := torch==2.13.0

.PHONY: demo test test-distro bench lint clean gpu-check

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
	$(PY) -m pytest -q $(TESTS) --durations=30

# The suites that read pickles written by other code (checkpoints, DeepSpeed side by side, the
# integrations) once more under the distribution's own python3 (Debian 12: 3.11.2), in a second
# venv holding the same packages: pickle's output depends on the interpreter's patch release
# (3.11.2 writes enum members by name), and users run the distro's python as often as ours.
DISTRO_PYTHON ?= /usr/bin/python3
DISTRO_VENV ?= .venv-distro
# Left out there: the side-by-side runs that read no file another interpreter pickled (generation,
# inference, TRL's trainers, Muon, the config corpus); they run once, in `make test`.
DISTRO_SKIP := $(addprefix --ignore=tests/,integrations/test_trl.py compat/test_inference_compat.py \
	compat/test_reference_model_compat.py compat/test_muon_compat.py compat/test_config_corpus.py)
test-distro:
	$(MAKE) --no-print-directory test PYTHON=$(DISTRO_PYTHON) VENV=$(DISTRO_VENV) \
		TESTS="tests/checkpoint tests/compat tests/integrations $(DISTRO_SKIP)"

# The GPU check (tests/cuda, marker `cuda`): accelerator, streams/events, pinned memory, offload
# copies, ZeRO 0-3 over NCCL on every visible GPU, bf16, and the step-time / MFU benchmark against
# DeepSpeed 0.19.8 (report: gpu-check-report.json). Needs a CUDA build of torch in GPU_PY's
# environment; one command, under 10 minutes on one GPU.
GPU_PY ?= $(PY)
gpu-check: $(VENV)/.test
	@$(GPU_PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: torch ' + torch.__version__ + ' sees no CUDA device; install a CUDA build of torch (or set GPU_PY)')"
	timeout 600 $(GPU_PY) -m pytest -q -rs -m cuda tests/cuda --timeout 450

bench: $(VENV)/.test
	$(PY) benchmarks/run.py

lint: $(VENV)/.test
	$(PIP) install -q ruff==0.17.6 mypy==2.4.1
	$(VENV)/bin/ruff check zerospeed tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) $(DISTRO_VENV) build *.egg-info
