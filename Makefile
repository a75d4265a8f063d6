# The README's two commands: `make quickstart` and `make test`. Each sets up
# everything it needs on a machine with only Python and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch where no GPU is needed (on the reference machines this pin
# resolves to a local CPU wheel). GPU machines: make quickstart TORCH=torch
TORCH ?= torch==2.13.0

.PHONY: quickstart test install install-dev clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

quickstart: install
	$(BIN)/mlplat quickstart

test: install-dev
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) quickstart outputs mlflow.db mlartifacts
