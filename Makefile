# Set-up and entry points. Every target builds its own virtual environment, so the
# commands work on a fresh machine with only Python 3.9+ and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# MXNet 1.9.1 needs numpy < 1.24, so the parameter-server tests (tests/mxnet) get their own
# environment: mxnet, numpy 1.23.5, pytest and bytescheduler (editable, without torch).
VENV_MXNET ?= .venv-mxnet
# torch is pinned for our CI and demo (its CPU wheel); the package itself accepts torch>=2.1.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup horovod lightning huggingface mxnet demo test test-frameworks microbench results docker docker-test clean

# The library (.) and beside it bytescheduler-tools (tools/: the benchmark, the demo, the simulator).
$(BIN)/.installed: setup.py tools/setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip setuptools wheel
	$(BIN)/python -m pip install --quiet "$(TORCH_PIN)"
	$(BIN)/python -m pip install --quiet -e ".[test]" -e ./tools
	touch $@

setup: $(BIN)/.installed

# Horovod 0.28.1 is compiled from source against the installed torch (several minutes the first
# time); the script keeps the wheel in ~/.cache/bytescheduler/wheels (or $BYTESCHEDULER_WHEEL_CACHE)
# and reuses it, and does nothing when a working Horovod is already installed.
$(BIN)/.horovod: $(BIN)/.installed scripts/install_horovod.sh
	TORCH_PIN="$(TORCH_PIN)" bash scripts/install_horovod.sh $(BIN)/python
	touch $@

horovod: $(BIN)/.horovod

# PyTorch Lightning for bytescheduler.lightning (tests/test_lightning.py), installed with the
# pinned torch in one pip call so that pip keeps it (lightning 2.6.6 takes torch>=2.1 and pulls
# no torchvision). Apart from `make setup`, so the demo and the Docker images stay lean.
LIGHTNING_PIN ?= lightning==2.6.6

$(BIN)/.lightning: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet "$(LIGHTNING_PIN)" "$(TORCH_PIN)"
	touch $@

lightning: $(BIN)/.lightning

# Hugging Face Accelerate and transformers for bytescheduler.accelerate and .transformers
# (tests/test_huggingface.py), with the pinned torch in one pip call so that pip keeps it
# (neither needs torchvision, whose wheels pull another torch).
HF_PINS ?= accelerate==1.15.0 transformers==5.24.0

$(BIN)/.huggingface: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet $(HF_PINS) "$(TORCH_PIN)"
	touch $@

huggingface: $(BIN)/.huggingface

# The script does nothing when the environment already works and setup.py is unchanged.
$(VENV_MXNET)/bin/.installed: setup.py tools/setup.py scripts/install_mxnet.sh
	PYTHON="$(PYTHON)" bash scripts/install_mxnet.sh $(VENV_MXNET)
	touch $@

mxnet: $(VENV_MXNET)/bin/.installed

# The README's demo: as root vgg-small on a 1 Gbit/s link first, then loopback (about two minutes).
demo: setup
	$(BIN)/bytescheduler bench --quick --out bench-results/quick

# docs/benchmarks.md's grid: every scheduled system on every bench model at every rate, each
# cell a bench run, then one table (docs/bench/grid/summary.md). As root (the shaped links need
# network namespaces); about 2.5 hours on a 2-core machine, with nothing else running.
results: setup $(BIN)/.horovod mxnet
	PYTHON_BIN=$(BIN) bash scripts/bench_matrix.sh docs/bench/grid

# Every test: the main suite, the MXNet suite, then the Docker images (docker-test, below).
test: test-frameworks docker-test

# The main environment has no MXNet: there tests/conftest.py leaves tests/mxnet out, and the
# second run collects it in the MXNet environment (where it fails loudly if MXNet is broken).
test-frameworks: setup $(BIN)/.horovod $(BIN)/.lightning $(BIN)/.huggingface mxnet
	$(BIN)/python -m pytest
	$(VENV_MXNET)/bin/python -m pytest tests/mxnet

# Docker images bytescheduler:pytorch, :horovod and :mxnet (docs/docker.md), set up by the targets
# above. With no Docker daemon running, one is started (as root) for the command and stopped after.
docker:
	bash scripts/with_dockerd.sh bash scripts/docker_build.sh

# Builds the images and runs tests/docker in them: the demo and a short scheduled run in each.
# Part of `make test`, after test-frameworks.
docker-test: setup
	bash scripts/with_dockerd.sh bash -c 'bash scripts/docker_build.sh && BYTESCHEDULER_DOCKER_TESTS=1 $(BIN)/python -m pytest tests/docker'

microbench: setup
	$(BIN)/bytescheduler microbench

clean:
	rm -rf $(VENV) $(VENV_MXNET) build *.egg-info bytescheduler_py/*.egg-info
