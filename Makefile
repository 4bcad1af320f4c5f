# Infinite-LLM in Python. `make run` and `make test` work on a fresh machine:
# they create .venv/ and install what they need; a second run reuses it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
MODEL_STAMP := .model_cache/.fetched

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

run: install model
	$(BIN)/infinite-llm generate --chat --max-tokens 64 \
		--prompt "In two sentences, what is the KV cache of a transformer and why does it grow with context length?"

test: install model
	$(BIN)/python -m pytest -q -ra

lint: install
	$(BIN)/ruff check infinite_llm tests benchmarks
	$(BIN)/ruff format --check infinite_llm tests benchmarks

bench: install model
	$(BIN)/python benchmarks/attention_bandwidth.py
	$(BIN)/python benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .model_cache .pytest_cache .ruff_cache
