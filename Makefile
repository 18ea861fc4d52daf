# Two commands do everything on a fresh machine:
#   make demo   set up, then generate with the bundled pair and run the quick benchmark
#   make test   set up, then run ruff, build the documentation site and run the whole test suite
#   make docs   the documentation site into build/site (make docs-serve: live at http://127.0.0.1:8000)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_PROMPT := import os\n\n\ndef read_lines(path):

.PHONY: setup demo test lint docs docs-serve clean llama-tools gpu-check

setup: $(VENV)/.installed

# torch first, pinned: an unpinned torch would pull gigabytes of CUDA packages.
# Then the package with every extra (the server, GGUF files, grammars, the benchmarks' output).
# The llama-cpp extra compiles llama.cpp (a portable CPU build, without its tools): about
# 10 CPU-minutes, once; pip keeps the wheel it builds for later installs.
# Then speculators (vLLM's EAGLE-3 format; the tests read our exports with its config classes
# and model) without its dependencies, which name torchvision and torchaudio (another torch);
# those its import needs are in the dev extra.
# Last, llama.cpp's CPU kernels for this CPU (the best variant it runs, row-invariant: see
# docs/gguf.md), about 5 CPU-minutes more, into the user's cache; where they cannot be built (no
# cmake or compiler), the llama.cpp backend runs on the extra's own library and setup goes on.
LLAMA_CPP_CMAKE := -DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/pip install -q -e '.[all,dev,llama-cpp]'
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(BIN)/specdecode kernels --build || echo "setup goes on: llama.cpp runs on llama-cpp-python's own library"
	touch $@

# The bundled pair: a continuation with its speed and acceptance, then the quick benchmark.
demo: setup
	$(BIN)/specdecode generate --temp 0 -n 128 -p "$$(printf '$(DEMO_PROMPT)')"
	$(BIN)/specdecode bench --quick --out build/bench-quick

# Optional, for the llama.cpp comparisons (see the README); no test needs them. llama.cpp's own
# programs (speculative-simple, lookup, completion, bench, server), for python -m
# specdecode.compare.llama_tools and bench-serve --http, from the llama-cpp-python source release
# of the installed version (the very llama.cpp the backend runs) into build/llama-tools, with
# their CPU kernels compiled for the best variant this CPU runs (`specdecode kernels
# --cmake-flags`: the instruction sets llama.cpp's releases choose at run time) and llamafile's
# sgemm and repacking on, as users get them.
LLAMA_TOOLS := build/llama-tools
LLAMA_TOOLS_TARGETS := llama-speculative-simple llama-lookup llama-completion llama-bench llama-server
LLAMA_TOOLS_CMAKE := -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF

# The source release, fetched once; prints the path of its llama.cpp.
LLAMA_CPP_SOURCE = version=$$($(BIN)/python -c \
		'import importlib.metadata as m; print(m.version("llama-cpp-python"))') && \
	release=$(LLAMA_TOOLS)/src/llama_cpp_python-$$version && \
	if [ ! -d $$release ]; then \
		$(BIN)/pip download -q --no-binary :all: --no-deps "llama-cpp-python==$$version" \
			-d $(LLAMA_TOOLS)/src && tar xzf $$release.tar.gz -C $(LLAMA_TOOLS)/src; \
	fi && source=$$release/vendor/llama.cpp

llama-tools: setup
	$(LLAMA_CPP_SOURCE) && \
	cmake -S $$source -B $(LLAMA_TOOLS)/cmake $(LLAMA_TOOLS_CMAKE) $$($(BIN)/specdecode kernels --cmake-flags) \
		-DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON && \
	cmake --build $(LLAMA_TOOLS)/cmake -j2 --target $(LLAMA_TOOLS_TARGETS)

# The GPU check (exactness, pass costs, speed against the strongest baselines with MBU, replayed
# real acceptance and the plan's goals on a CUDA GPU, about 8 minutes on an H200) into
# build/gpu-check/gpu_check.{json,md}. It runs on the system's Python, without the venv: a GPU
# machine has torch, transformers and their kin installed. GPU_CHECK_ARGS=--quick for smaller sizes.
gpu-check:
	PYTHONPATH=src $(PYTHON) -m specdecode.compare.gpu_check --out build/gpu-check $(GPU_CHECK_ARGS)

lint: setup
	$(BIN)/ruff check src tests

# The documentation site (mkdocs.yml, docs/); --strict fails on a broken link or a page left
# out of the nav. docs/cli.md is filled with each subcommand's --help at build time.
docs: setup
	$(BIN)/mkdocs build --strict

docs-serve: setup
	$(BIN)/mkdocs serve

# Without the theme's end-of-life banner, and never with -q/--quiet: quiet mode drops the
# warnings that --strict counts, so a broken link would pass.
test: lint
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build
