# Set-up and entry points. Every target builds its own virtual environment, so the
# commands work on a fresh machine with only Python 3.9+ and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned for our CI and demo (its CPU wheel); the package itself accepts torch>=2.1.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test microbench clean

$(BIN)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/bytescheduler demo

test: setup
	$(BIN)/python -m pytest

microbench: setup
	$(BIN)/bytescheduler microbench

clean:
	rm -rf $(VENV) build *.egg-info bytescheduler_py/*.egg-info
