# Set-up and the two everyday commands. Everything installs into .venv on first use.
#   make demo   - the main job on the offline tiny models (CPU, a few minutes)
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
	$(PY) -m workers.tiny models/tiny
	$(PY) -m workers.bench --target models/tiny/target --drafter models/tiny/drafter --prompts models/tiny/prompts.jsonl \
		--dtype float32 --method ddtree --tree-budget 32 --max-new-tokens 64

test: install
	$(PY) -m pytest -q
