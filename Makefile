# `make demo` and `make test` set everything up (a virtualenv in .venv) and run.
PYTHON ?= python3
# pip index for torch: empty = pip's configured index (on Linux, PyPI's torch is the CUDA build);
# `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` installs the CPU-only build
TORCH_INDEX ?=
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench fuzz clean browser

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q numpy
	$(BIN)/pip install -q -e ".[test,bench]"
	touch $(STAMP)

# Headless Chromium for the HTML tests of `effectfx show` (tests/test_show.py).  Installed from Debian's
# packages when missing and apt is available; otherwise those tests skip and say why.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif ! command -v apt-get >/dev/null 2>&1; then \
		echo "browser: no /usr/bin/chromium and no apt-get; the headless-browser tests will skip"; \
	else \
		SUDO=""; [ "$$(id -u)" = 0 ] || SUDO="sudo -n"; \
		( $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends chromium ) \
		|| echo "browser: could not install chromium; the headless-browser tests will skip"; \
	fi

demo: $(STAMP)
	$(BIN)/python -m effectfx demo

test: $(STAMP) browser
	$(BIN)/ruff check effectfx tests benchmarks examples
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check effectfx tests benchmarks examples

bench: $(STAMP)
	$(BIN)/python -m effectfx bench

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
