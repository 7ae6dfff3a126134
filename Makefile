# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job: a DDTree sweep on the offline demo pair (CPU, a few minutes), then its report;
#                 the first run also trains the pair on this Python's own standard library (longer; README
#                 "The demo pair"), cached in models/demo
#   make test   - the test suite (CPU; the README's test command)
#   make test-fast - the unit tests without the real subprocess sweeps (a few minutes)
#   make test-gpu - on a CUDA machine (TORCH=torch): the GPU-marked tests (each Triton kernel against its
#                 torch form, graphs, splits) and the kernels' resource check for this and other GPUs
#   make test-kernels - no GPU needed (CI runs it): the Triton kernels against their torch forms through
#                 Triton's CPU interpreter, and their shared memory on an RTX A6000 compiled ahead of time;
#                 installs triton 3.6.0 into .triton (beside the CPU torch, which has none)
#   make lint   - ruff: pyflakes, import order, line length (CI runs it before the tests)
# TORCH picks the torch requirement: the default is the CPU build; on a CUDA machine use TORCH=torch.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
KERNELS := .triton

.PHONY: install demo test test-fast test-gpu test-kernels lint

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m workers.demo_pair models/demo
	$(PY) -m orchestrator.sweep sweeps/demo.yaml
	$(PY) -m orchestrator.report sweeps/demo.yaml

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not sweep"

test-gpu: install
	$(PY) -m pytest -q -m gpu tests/workers
	$(PY) -m pytest -q tests/workers/models/test_kernel_resources.py

$(KERNELS)/.installed: $(VENV)/.installed
	$(PY) -m pip install --quiet --upgrade --target $(KERNELS) "triton==3.6.0"
	touch $@

test-kernels: $(KERNELS)/.installed
	PYTHONPATH=$(KERNELS) TRITON_INTERPRET=1 $(PY) -m pytest -q tests/workers/models/test_interpreted_kernels.py
	PYTHONPATH=$(KERNELS) $(PY) -m pytest -q tests/workers/models/test_kernel_resources.py

lint: install
	$(PY) -m ruff check workers orchestrator tests benchmarks
