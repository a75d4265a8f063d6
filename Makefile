# The README's two commands: `make quickstart` and `make test`. Each sets up
# everything it needs on a machine with only Python and pip.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch where no GPU is needed (on the reference machines this pin
# resolves to a local CPU wheel). GPU machines: make quickstart TORCH=torch
TORCH ?= torch==2.13.0

.PHONY: quickstart test test-fast install install-dev kernels prometheus redis clean gpu-check

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

# Two pytest-xdist workers: one runs the tests on the session's Ray cluster, the other everything else beside it
# (tests/conftest.py; docs/testing.md).
test: install-dev kernels prometheus redis
	$(BIN)/python -m pytest -q -ra --durations=25 -n 2 --dist loadgroup

# The unit tests alone: no Ray cluster, no end-to-end runs (under 2 minutes on 2 cores).
test-fast: install-dev
	$(BIN)/python -m pytest -q -ra -n 2 -m "not cluster and not slow"

# The prepared GPU check (issue 38, docs/gpu.md): Ray-, MLflow-free, from the source tree, so it installs nothing
# (`pip install -e .` would fetch Ray); this checkout's venv if there is one, else python3; PYTHONPATH from the
# environment is kept after platform/ (wheels installed with --target, docs/gpu.md). On a GPU machine:
# `make gpu-check`; on CPU: `make gpu-check GPU_CHECK_ARGS="--device cpu --quick"` (the run tests/test_gpucheck.py makes).
GPU_CHECK_OUT ?= outputs/gpucheck
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=platform$(if $(PYTHONPATH),:$(PYTHONPATH)) $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m mlplat.gpucheck --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# The engine's C++ CPU kernels (mlplat.engine.cpu_kernels), built once per source and CPU under
# ~/.cache/torch_extensions (~20 s on 2 cores): a build step before the tests rather than inside the
# first test that starts an engine. Never fails the build: the engine falls back to plain PyTorch.
kernels: install
	@$(BIN)/python -c "from mlplat.engine import cpu_kernels; cpu_kernels.load() or print('make: the CPU kernels could not be built; the engine falls back to plain PyTorch')"

# Debian's prometheus for tests/test_observability_prometheus.py, and its promtool for tests/test_alerts.py
# (one package; root, as in CI). Never fails the build: without apt (or root) those tests skip and say
# why, except under CI=true, where a missing promtool fails its test.
prometheus:
	@{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]' || apt-get update -qq >/dev/null 2>&1; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
	      || echo "make: could not install prometheus with apt; its tests (and promtool's) will skip"; \
	  else echo "make: no apt-get as root here; prometheus not installed, its tests (and promtool's) will skip"; fi; }

# Debian's redis-server for tests/test_gcs_fault_tolerance.py (a Ray head whose GCS keeps its tables in Redis).
# Never fails the build, like prometheus: without it that test skips and says why, except under CI=true.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-cache policy redis-server 2>/dev/null | grep -q 'Candidate: [0-9]' || apt-get update -qq >/dev/null 2>&1; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 \
	      || echo "make: could not install redis-server with apt; the GCS fault-tolerance test will skip"; \
	  else echo "make: no apt-get as root here; redis-server not installed, the GCS fault-tolerance test will skip"; fi; }

clean:
	rm -rf $(VENV) quickstart outputs mlflow.db mlartifacts
