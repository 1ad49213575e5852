# Two set-up-and-go targets: `make bench` (the default benchmark comparison) and
# `make test` (lint, type check, tests). Both create .venv and install what they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is pinned for this install only: a CPU wheel of 2.13.0 is available offline,
# an unpinned resolve pulls a newer torch with several GB of CUDA packages.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

# backpack-for-pytorch declares torchvision (only its unused backpack.utils.examples
# imports it), so pip installs PyPI's wheel, which is built for PyPI's CUDA torch: next
# to the CPU torch pinned here its import fails ("operator torchvision::nms does not
# exist"). torchmetrics, which Lightning imports, checks the installed *metadata*
# (lightning_utilities' RequirementCache("torchvision")) and then imports torchvision,
# so a broken torchvision breaks `import lightning`; no environment variable turns that
# off. Hence: uninstall torchvision when it does not import (a working one stays).
# Nothing in this project imports torchvision.
define drop_broken_torchvision
$(1) -c "import torchvision" 2>/dev/null || $(1) -m pip uninstall --quiet -y torchvision
endef

.PHONY: test test-floor bench lint format clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@echo "Installing $(TORCH_PIN) + BackPACK, Hydra, matplotlib, ruff, mypy, pytest into $(VENV) (~2 min the first time)..."
	$(PY) -m pip install --quiet "$(TORCH_PIN)" -e ".[test]"
	$(call drop_broken_torchvision,$(PY))
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q -n 2

# The sweep prints its job count and expected time first, and ends with the report and
# a trade-off paragraph (steps to a target against time per step) from its own results.
bench: $(STAMP)
	$(PY) -m benchmarks.run --multirun +sweep=default

# The suite on the lowest torch pyproject.toml admits (`torch>=X.Y` → the newest X.Y.*),
# in its own .venv-floor; not part of `make test`. PyPI's Linux wheels of torch are CUDA
# builds that import only with their nvidia-* packages (~3 GB the first time); pass
# FLOOR_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu
# --extra-index-url https://pypi.org/simple" for the CPU build where that index is
# reachable.
FLOOR_VENV := .venv-floor
TORCH_FLOOR := $(shell sed -n 's/^ *"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
FLOOR_PIP_ARGS ?=

test-floor: pyproject.toml
	test -d $(FLOOR_VENV) || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install --quiet $(FLOOR_PIP_ARGS) "torch==$(TORCH_FLOOR).*" -e ".[test]"
	$(call drop_broken_torchvision,$(FLOOR_VENV)/bin/python)
	$(FLOOR_VENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(FLOOR_VENV)/bin/python -m pytest -q -n 2

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(FLOOR_VENV) outputs multirun
