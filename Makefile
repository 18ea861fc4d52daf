# Two commands do everything on a fresh machine:
#   make demo   set up, then generate with the bundled pair and run the quick benchmark
#   make test   set up, then run ruff and the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_PROMPT := import os\n\n\ndef read_lines(path):

.PHONY: setup demo test lint clean

setup: $(VENV)/.installed

# torch first, pinned: an unpinned torch would pull gigabytes of CUDA packages.
# The llama-cpp extra compiles llama.cpp (a portable CPU build, without its tools): about
# 10 CPU-minutes, once; pip keeps the wheel it builds for later installs.
# Last, speculators (vLLM's EAGLE-3 format; the tests read our exports with its config classes
# and model) without its dependencies, which name torchvision and torchaudio (another torch);
# those its import needs are in the dev extra.
LLAMA_CPP_CMAKE := -DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/pip install -q -e '.[dev,llama-cpp]'
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	touch $@

# The bundled pair: a continuation with its speed and acceptance, then the quick benchmark.
demo: setup
	$(BIN)/specdecode generate --temp 0 -n 128 -p "$$(printf '$(DEMO_PROMPT)')"
	$(BIN)/specdecode bench --quick --out build/bench-quick

lint: setup
	$(BIN)/ruff check src tests

test: lint
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build
