# One command per task; CI (.ci/run) calls these same targets.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
# Agent CLIs `setup` installs (scripts/setup.sh): `make test HARNESSES=none` skips them, as the
# default tier does not run them; .ci/run installs them meanwhile.
HARNESSES ?= all

.PHONY: help setup vllm smoke smoke-vllm test test-slow test-harness test-containers test-vllm test-ray test-slurm test-gpu test-learning check docs house bench

help:
	@echo "make smoke        install everything, run the CPU smoke job (+experiment=smoke)"
	@echo "make vllm         build vLLM's own environment in the cache (the CPU build on a machine without a GPU)"
	@echo "make smoke-vllm   the smoke job on real vLLM (its CPU build here)"
	@echo "make test         install everything, run the default test tier"
	@echo "make test-slow    integration tier (tiny models trained on CPU, real servers, end to end)"
	@echo "make test-harness real agent CLIs end to end through the proxy"
	@echo "make test-containers the docker sandbox on a real dockerd (started and stopped here; installs docker.io)"
	@echo "make test-vllm    real vLLM (CPU build): serving, both weight syncs, parity gate, smoke runs; 0.33's parser"
	@echo "make test-ray     attempts on a local Ray cluster (scheduler.backend=ray): node death, SIGTERM, smoke run"
	@echo "make test-slurm   scripts/slurm/ray_cluster.sbatch on a one-node SLURM started here (installs slurm-wlm, munge)"
	@echo "make test-gpu     vLLM contract suite and launch checks (GPU machine)"
	@echo "make test-learning the reduced mini-reproduction: RL must raise held-out pass@1 (16-38 min)"
	@echo "make check        ruff + mypy + the docs build"
	@echo "make docs         the docs site (mkdocs, warnings are errors) into .site/"
	@echo "make house        the house's measures against their targets (scripts/house.py)"
	@echo "make bench        engine, proxy, tree, agent-start and replicas benchmarks"

setup:
	scripts/setup.sh $(HARNESSES)

smoke: setup
	$(PY) -m fineenvs.run +experiment=smoke

vllm: setup
	$(PY) -m fineenvs.engine install-vllm

smoke-vllm: vllm
	$(PY) -m fineenvs.run +experiment=smoke engine=vllm

test: setup
	$(PYTEST) -q

# The harness tier's slow tests (every real agent CLI against a random tiny model) are marked slow
# too; they run once, in test-harness.
test-slow: setup
	$(PYTEST) -q -m "slow and not harness" --durations=15

test-harness: setup
	$(PYTEST) -q -m "harness and not containers" --durations=15

# The docker sandbox (scheduler.sandbox=docker) against a real daemon: scripts/dockerd.sh starts one
# where none answers (no bridge, no iptables rules) and stops it afterwards, also when a test fails.
test-containers: setup
	scripts/dockerd.sh start
	$(PYTEST) -q -m containers --durations=10; status=$$?; scripts/dockerd.sh stop; exit $$status

# vLLM's CPU build serves; vLLM 0.33.0 (the GPU release) only parses and validates.
test-vllm: setup
	$(PY) -m fineenvs.engine install-vllm --build cpu
	$(PY) -m fineenvs.engine install-vllm --build parser
	$(PY) -m fineenvs.engine install-vllm-client
	$(PY) -m fineenvs.engine install-router
	$(PYTEST) -q -m vllm --durations=15

# Ray is an optional extra (pyproject `ray`): installed here, not by setup, so the other tiers
# run without it.
test-ray: setup
	$(PY) -c "import ray" 2>/dev/null || $(VENV)/bin/pip install -q 'ray==2.60.0'
	scripts/dockerd.sh start
	RAY_USAGE_STATS_ENABLED=0 $(PYTEST) -q -m ray --durations=15; status=$$?; scripts/dockerd.sh stop; exit $$status

# The SLURM template for real: a one-node SLURM on this machine (scripts/slurm/local_slurm.sh,
# state in /tmp/fineenvs-slurm), started and stopped here like dockerd for test-ray.
test-slurm: setup
	$(PY) -c "import ray" 2>/dev/null || $(VENV)/bin/pip install -q 'ray==2.60.0'
	scripts/slurm/local_slurm.sh start
	RAY_USAGE_STATS_ENABLED=0 $(PYTEST) -q -m slurm --durations=15; status=$$?; scripts/slurm/local_slurm.sh stop; exit $$status

test-gpu: setup
	$(PYTEST) -q -m gpu

test-learning: setup
	$(PYTEST) -q -m learning

check: setup
	$(VENV)/bin/ruff check fineenvs benchmarks tests scripts
	$(VENV)/bin/ruff format --check fineenvs benchmarks tests scripts
	$(VENV)/bin/mypy
	$(DOCS)

# The docs site: strict, so a broken link, a missing anchor or a page left out of the nav fails.
DOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .site
docs: setup
	$(DOCS)

# How the house stands (issue 33's measures): library vs scaffolding, homes per setting, duplicates,
# Any, long functions, README size, run history in docs, config errors outside validation.
house: setup
	$(PY) scripts/house.py

bench: setup
	$(PY) -m benchmarks engine
	$(PY) -m benchmarks proxy
	$(PY) -m benchmarks tree
	$(PY) -m benchmarks agent-start
	$(PY) -m fineenvs.engine install-router
	$(PY) -m benchmarks replicas
