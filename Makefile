# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs the pinned package, trains the embedded default
#   make test   the same set-up plus what the tests need, then every test (what .ci/run calls)
# Narrower runs (docs/testing.md):
#   make lint            ruff (lint + format check) and mypy over src/: part of make test
#   make test-unit       the unit tier only (under a minute)
#   make test-numerics   the equivalence tests again under torch's portable CPU kernels
#   make test-slow       the `slow` tests alone (compile, bf16 on CPU, planner cases): in make test too
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test lint test-unit test-numerics test-slow setup setup-test clean

# What `make demo` needs: the package and its pinned dependencies. torch goes first: pip
# takes the local CPU wheel for the exact pin, whereas an open range resolved by another
# package would pull a multi-GB CUDA build.
setup: $(VENV)/.installed

# Then the editable package's bytecode, written once: pip compiles what it installs into
# site-packages, not a source tree, and where PYTHONDONTWRITEBYTECODE is set (it is on this
# project's machines) every process compiled scaletrain's modules again (~0.1 s of a core).
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m compileall -q src/scaletrain
	touch $@

# What the tests need besides: the test extras, DeepSpeed's CPU ops compiled once (a JIT
# build inside the first DeepSpeed test would cost minutes of its timeout), Debian's
# libaio-dev, which DeepSpeed's async_io op links for NVMe offload (tests/test_nvme_offload.py;
# before the ops, which build async_io only where libaio is found), Debian's ninja-build (a
# ninja of another version than the environment's, which tests/test_deepspeed_tools.py puts
# first on PATH to show the ops are not rebuilt), and Debian's chromium,
# which renders diagnose's report.html in tests/test_diagnose.py. Both are installed where
# absent and apt-get is usable (root); elsewhere their tests fail saying what to install.
setup-test: $(VENV)/.installed-test

# lm-evaluation-harness, what tests/test_tasks.py checks eval.tasks against: into a directory of
# its own (the tests append it to sys.path last), its shared dependencies held to this
# environment's versions, so that nothing of ours changes under it.
LM_EVAL := lm-eval==0.4.13

# torchtitan's Llama-3 trainer, the torchtitan row of tests/test_gpu_peers.py (scripts/gpu_peers.py puts
# the folder first on that row's path alone: TITAN_SITE): into a directory of its own as well, but
# without its requirements (wandb, torch_checkpointing, grpcio, ...: --no-deps), only what its
# one-process Llama-3 path imports and this environment lacks, at the versions the lent GPU ran
# (.whl/titan; tensorboard, absl-py and pandas are in its image): 20 MB to fetch, 66 MB, 4 s.
TITAN := torchtitan==0.3.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 pandas==3.1.1 tyro==1.0.17 \
	typeguard==4.6.1 docstring-parser==0.18.0 torchdata==0.11.0 spmd-types==0.2.3 tensorboard==2.21.0 absl-py==2.5.1

#
# The ops build (minutes of both cores, compiled without debug information: launch/env.py) runs beside the rest: pip's download of the
# test extras and apt's chromium wait mostly on the network and disk. The extras are named
# from pyproject.toml rather than installed as '.[test]', which would reinstall the package
# itself while the build's worker processes import it; every one of them is a package the
# main set-up does not have (`pip install --dry-run` lists only new ones), so nothing the
# build imports changes under it.
$(VENV)/.installed-test: $(VENV)/.installed
	{ [ -e /usr/include/libaio.h ] && [ -x /usr/bin/ninja ]; } || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] || \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q --no-install-recommends libaio-dev ninja-build || \
		(apt-get update -q && apt-get install -y -q --no-install-recommends libaio-dev ninja-build))
	$(BIN)/python -m scaletrain.engines.deepspeed_ops & ops=$$!; \
	$(BIN)/python -m pip install --quiet $$($(BIN)/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))') && \
	$(BIN)/python -m pip freeze --exclude-editable | grep -v '^#' > $(VENV)/constraints.txt && \
	$(BIN)/python -m pip install --quiet --no-compile --constraint $(VENV)/constraints.txt --target $(VENV)/lm-eval $(LM_EVAL) && \
	$(BIN)/python -m pip install --quiet --no-compile --no-deps --constraint $(VENV)/constraints.txt --target $(VENV)/torchtitan $(TITAN) && \
	{ command -v chromium >/dev/null || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] || \
		(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q --no-install-recommends chromium || \
		(apt-get update -q && apt-get install -y -q --no-install-recommends chromium)); }; \
	rest=$$?; wait $$ops && [ $$rest -eq 0 ]
	touch $@

# The embedded default, evaluated every 100 steps on 1% of its documents, held out: so that
# `scaletrain eval runs/demo` (README) has held-out documents to evaluate the checkpoint on.
demo: setup
	$(BIN)/scaletrain train eval.every=100

# Every test, in two parts. Most tests wait on subprocesses (imports, rendezvous, gloo):
# two at a time keep both cores busy (one worker per test file, so a module's shared runs
# are made once). The lint runs beside that part (mypy: ~25 s of one core, which the two
# workers' waits absorb), its output kept until the part ends; either failing fails it.
# The tests that judge timing (`serial`) run afterwards, alone.
test: setup-test
	$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial"; tests=$$?; \
	wait $$lint; linted=$$?; cat $(VENV)/lint.log; [ $$tests -eq 0 ] && [ $$linted -eq 0 ]
	$(BIN)/python -m pytest -q -m serial

lint: setup-test
	$(BIN)/ruff check src tests scripts examples
	$(BIN)/ruff format --check src tests scripts examples
	$(BIN)/mypy

test-unit: setup-test
	$(BIN)/python -m pytest -q -m unit

# Sums round differently with each CPU kernel family (avx512, avx2, default): the
# tolerances must hold under all of them, not only under this machine's own.
test-numerics: setup-test
	ATEN_CPU_CAPABILITY=$(or $(CAPABILITY),default) $(BIN)/python -m pytest -q -m equivalence

test-slow: setup-test
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) runs data
