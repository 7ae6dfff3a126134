# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job: a DDTree sweep on the offline demo pair (trained once on this Python's own
#                 standard library, CPU, a few minutes; cached in models/demo), then its report
#   make test   - the test suite (CPU)
# TORCH picks the torch requirement: the default is the CPU build; on a CUDA machine use TORCH=torch.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test

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
