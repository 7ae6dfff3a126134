# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job: a DDTree sweep on the shipped demo pair (data/demo_pair; CPU, a few minutes,
#                 nothing to train), then its report
#   make test   - the test suite (CPU; the README's test command)
#   make test-fast - the tests without whole sweeps (sweep) and long ones (slow: CLIs in subprocesses, Ray
#                 actors, process groups, the full exactness matrix); make test runs everything
#   make test-gpu - on a CUDA machine (TORCH=torch): the GPU-marked tests (each Triton kernel against its
#                 torch form, graphs, splits) and the kernels' resource check for this and other GPUs
#   make test-kernels - no GPU needed (CI runs it): the Triton kernels against their torch forms through
#                 Triton's CPU interpreter, their shared memory on an RTX A6000 compiled ahead of time, and
#                 that each waits for its inputs first (PDL, test_pdl.py); installs triton 3.6.0 into .triton
#                 (beside the CPU torch, which has none)
#   make lint   - ruff: pyflakes, import order, line length (CI runs it before the tests)
# TORCH picks the torch requirement: the default is the CPU build; on a CUDA machine use TORCH=torch.
# README.md gives each target's time on a 2-core machine.
# The suite runs in WORKERS pytest processes (pytest-xdist), a test file to each at a time (--dist
# loadfile: a file's shared sweeps and Ray clusters are built once). Most of its time is sweeps in
# subprocesses (start-up, Ray, actors, much of it waiting), so two at a time finish well before one
# at a time on a 2-core machine (README.md). Each test process and its children use one torch thread
# (OMP_NUM_THREADS=1): the tiny test models gain nothing from intra-op threads, which would contend.
PYTHON ?= python3
CPU_TORCH := torch==2.13.0
TORCH ?= $(CPU_TORCH)
# with any other torch (a CUDA machine) the gpu extra too: fla-core's tensor-core chunked Gated DeltaNet
# for the hybrids' prompts, nvmath-python's cuBLASLt for the per-shape product choice (pyproject.toml);
# the CPU build never runs them
COMMA := ,
EXTRAS := $(if $(filter $(CPU_TORCH),$(TORCH)),test,test$(COMMA)gpu)
VENV := .venv
PY := $(VENV)/bin/python
KERNELS := .triton
WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(WORKERS) --dist loadfile
# Python may write the bytecode of what a run imports (some machines set PYTHONDONTWRITEBYTECODE): the
# install skips byte-compiling (below), so without this every subprocess of the suite (sweeps, Ray
# workers) would compile torch, transformers and the rest from source again, seconds each
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-fast test-gpu test-kernels lint

# pip stays quiet, so each step says what it does (a few minutes on a fresh machine). --no-compile:
# pip would byte-compile every installed module (torch, ray, mlflow: a large share of the install's
# time); Python compiles the ones a run imports, once, on first import.
PIP := $(PY) -m pip install --quiet --no-compile
$(VENV)/.installed: pyproject.toml
	@echo "make: creating $(VENV) with $(PYTHON) ..."
	$(PYTHON) -m venv $(VENV)
	@echo "make: upgrading pip ..."
	$(PIP) --upgrade pip
	@echo "make: installing $(TORCH) (the CPU build unless TORCH says otherwise) ..."
	$(PIP) "$(TORCH)"
	@echo "make: installing the project and its extras [$(EXTRAS)] (ray, optuna, mlflow, transformers, pytest, ...) ..."
	$(PIP) -e ".[$(EXTRAS)]"
	touch $@
	@echo "make: $(VENV) is ready"

install: $(VENV)/.installed

demo: install
	@echo "make: running sweeps/demo.yaml on the shipped demo pair (data/demo_pair) ..."
	$(PY) -m orchestrator.sweep sweeps/demo.yaml
	@echo "make: the report (python -m orchestrator.report sweeps/demo.yaml) ..."
	$(PY) -m orchestrator.report sweeps/demo.yaml

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not sweep and not slow"

test-gpu: install
	$(PY) -m pytest -q -m gpu tests/workers
	$(PY) -m pytest -q tests/workers/models/test_kernel_resources.py

$(KERNELS)/.installed: $(VENV)/.installed
	$(PIP) --upgrade --target $(KERNELS) "triton==3.6.0"
	touch $@

test-kernels: $(KERNELS)/.installed
	PYTHONPATH=$(KERNELS) TRITON_INTERPRET=1 $(PY) -m pytest -q tests/workers/models/test_interpreted_kernels.py
	PYTHONPATH=$(KERNELS) $(PY) -m pytest -q tests/workers/models/test_kernel_resources.py tests/workers/models/test_pdl.py

lint: install
	$(PY) -m ruff check workers orchestrator tools tests benchmarks
