# Set-up and entry points. Every target builds its own virtual environment, so the
# commands work on a fresh machine with only Python 3.9+ and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned for our CI and demo (its CPU wheel); the package itself accepts torch>=2.1.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup horovod demo test microbench clean

$(BIN)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

setup: $(BIN)/.installed

# Horovod 0.28.1 is compiled from source against the installed torch (several minutes the first
# time); the script keeps the wheel in ~/.cache/bytescheduler/wheels (or $BYTESCHEDULER_WHEEL_CACHE)
# and reuses it, and does nothing when a working Horovod is already installed.
$(BIN)/.horovod: $(BIN)/.installed scripts/install_horovod.sh
	TORCH_PIN="$(TORCH_PIN)" bash scripts/install_horovod.sh $(BIN)/python
	touch $@

horovod: $(BIN)/.horovod

demo: setup
	$(BIN)/bytescheduler demo

test: setup $(BIN)/.horovod
	$(BIN)/python -m pytest

microbench: setup
	$(BIN)/bytescheduler microbench

clean:
	rm -rf $(VENV) build *.egg-info bytescheduler_py/*.egg-info
