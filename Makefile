# Infinite-LLM in Python. `make run` and `make test` work on a fresh machine:
# they create .venv/ and install what they need; a second run reuses it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install model run test lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and exact: it is the CPU wheel on disk (ENV.md).
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	rm -f $(VENV)/.installed-*
	touch $@

model: install
	$(BIN)/infinite-llm fetch-model

# The main job: the local mesh (etcd, manager, 3 attention servers each too small for the context, a compute
# instance, the router) answers a question about a real document that ships with the OS (~2,300 tokens),
# streaming the answer, then prints where the request's rBlocks lived and the tokens/s.
DOC ?= /usr/share/common-licenses/Apache-2.0
QUESTION ?= According to this license, what must you do when you redistribute the Work? Answer briefly.
run: install model
	$(BIN)/python -m infinite_llm.main_job --doc "$(DOC)" --question "$(QUESTION)"

test: install model lm-eval-venv aiperf-venv
	$(BIN)/python -m pytest -q -ra --durations=60 -n 2

# lm-eval runs in the tests from a virtual environment of its own: its dependencies clash with the project's
# (python-dateutil < 3 for its table writer, >= 3 for the Kubernetes client). torch is the CPU wheel, exact;
# transformers is the project's own pin (lm-eval tokenizes with it, as the gateway does).
LM_EVAL_VENV := .venv-lm-eval
.PHONY: lm-eval-venv
lm-eval-venv: $(LM_EVAL_VENV)/.installed

$(LM_EVAL_VENV)/.installed:
	test -x $(LM_EVAL_VENV)/bin/python || $(PY) -m venv $(LM_EVAL_VENV)
	$(LM_EVAL_VENV)/bin/python -m pip install --quiet torch==2.13.0 'lm-eval[api]==0.4.13' transformers==5.23.0
	touch $@

# aiperf (NVIDIA's load generator for OpenAI-compatible servers) runs in the tests from a virtual environment
# of its own too: it pins ~150 packages (transformers 5.24, python-dateutil 4, pyarrow, dash, ...) that clash
# with the project's. It needs no torch. tests/e2e/test_aiperf.py fails when it is missing, unless
# INFINITE_LLM_TESTS_SKIP_AIPERF=1. Building it downloads ~1.2 GB of wheels: minutes (18 on a loaded machine).
AIPERF_VENV := .venv-aiperf
.PHONY: aiperf-venv
aiperf-venv: $(AIPERF_VENV)/.installed

$(AIPERF_VENV)/.installed:
	test -x $(AIPERF_VENV)/bin/python || $(PY) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install --quiet aiperf==0.13.0
	touch $@

lint: install
	$(BIN)/ruff check infinite_llm tests benchmarks
	$(BIN)/ruff format --check infinite_llm tests benchmarks

bench: install model
	$(BIN)/python benchmarks/attention_bandwidth.py
	$(BIN)/python benchmarks/engine_throughput.py
	$(BIN)/python benchmarks/mesh_overhead.py
	$(BIN)/python benchmarks/step_streams.py
	$(BIN)/python benchmarks/attention_server_layer.py

clean:
	rm -rf $(VENV) $(LM_EVAL_VENV) $(AIPERF_VENV) .pytest_cache .ruff_cache

# Generated protobuf/gRPC code is checked in (installs need no protoc); protos/generate.py documents the
# layout. proto-check regenerates into a temporary directory and fails when the committed code is stale.
.PHONY: proto proto-check
proto: install
	$(BIN)/python protos/generate.py

proto-check: install
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		$(BIN)/python protos/generate.py --out "$$tmp" >/dev/null && \
		diff -r -x __pycache__ "$$tmp" infinite_llm/pb/v1 && echo "generated code is up to date" || \
		{ echo "infinite_llm/pb/v1 is stale: run 'make proto'" >&2; exit 1; }
