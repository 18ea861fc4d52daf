# Two commands do everything on a fresh machine:
#   make demo   set up, then run speculative generation and the plain-vs-speculative benchmark
#   make test   set up, then run ruff and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO := build/demo
DEMO_PROMPT := def fibonacci(n):\n

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# torch first, pinned: an unpinned torch would pull gigabytes of CUDA packages.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

$(DEMO)/target/config.json: | setup
	$(BIN)/python -m specdecode.testing $(DEMO)

demo: setup $(DEMO)/target/config.json
	$(BIN)/specdecode generate -m $(DEMO)/target -md $(DEMO)/draft --draft-max 8 --temp 0 -n 64 \
		-p "$$(printf '$(DEMO_PROMPT)')"
	$(BIN)/specdecode bench -m $(DEMO)/target -md $(DEMO)/draft --draft-max 8 -n 64 --runs 3

lint: setup
	$(BIN)/ruff check src tests

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build
