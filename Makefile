# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs the pinned dependencies, trains the embedded default
#   make test   same set-up, then the whole test suite (what .ci/run calls)
# Narrower runs (docs/testing.md):
#   make lint            ruff (lint + format check) and mypy over src/: part of make test
#   make test-unit       the unit tier only (under a minute)
#   make test-numerics   the equivalence tests again under torch's portable CPU kernels
#   make test-slow       the tests too slow for make test's 15 minutes (compile, bf16 on CPU, planner cases)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint test-unit test-numerics test-slow setup clean

setup: $(VENV)/.installed

# torch goes first: pip takes the local CPU wheel for the exact pin, whereas an open range
# resolved by another package would pull a multi-GB CUDA build.
# Debian's chromium renders diagnose's report.html in tests/test_diagnose.py: installed where
# it is absent and apt-get is usable (root); elsewhere that test fails saying what to install.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m scaletrain.engines.deepspeed_ops
	command -v chromium >/dev/null || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] || \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q --no-install-recommends chromium || \
		(apt-get update -q && apt-get install -y -q --no-install-recommends chromium))
	touch $@

demo: setup
	$(BIN)/scaletrain train

# `slow` tests (a minute of compiling or of bf16 emulated on a CPU, 2 cores) are left to
# `make test-slow` (and `make test-numerics` reruns those that compare numbers): the
# 15-minute budget of `make test` has no room for them.
# Most tests wait on subprocesses (imports, rendezvous, gloo): two at a time keep both
# cores busy (one worker per test file, so a module's shared runs are made once). The
# tests that judge timing run afterwards, alone.
test: setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial and not slow"
	$(BIN)/python -m pytest -q -m serial

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

test-unit: setup
	$(BIN)/python -m pytest -q -m unit

# Sums round differently with each CPU kernel family (avx512, avx2, default): the
# tolerances must hold under all of them, not only under this machine's own.
test-numerics: setup
	ATEN_CPU_CAPABILITY=$(or $(CAPABILITY),default) $(BIN)/python -m pytest -q -m equivalence

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs data
