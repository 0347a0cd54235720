# `make demo` and `make test` set everything up (a virtualenv in .venv) and run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0" numpy
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m effectfx demo

test: $(STAMP)
	$(BIN)/ruff check effectfx tests benchmarks examples
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check effectfx tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python -m effectfx bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
