# Two commands from a fresh clone:
#   make train     runs the pipeline's main target on the embedded default
#   (make paper    then evaluates every run and writes the figures and tables)
#   make test      runs the fast tier of the test suite (unit tests, the smoke pipeline and the cheap tests
#                  that read it); make test-all runs every test (docs/testing.md)
# Each creates its Python environment (.venvs/$(STACK)) from envs/$(STACK).yaml if it is missing or
# older than the env file, and reuses it otherwise. STACK=pinned (default) or STACK=current.

STACK ?= pinned
PYTHON ?= python3
CORES ?= 8
VENV := .venvs/$(STACK)
BIN := $(VENV)/bin
SNAKEMAKE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: env train paper test test-all lint format clean gpu-check gpu-bundle device-env serve-env slurm-up slurm-down

$(VENV)/.installed: envs/$(STACK).yaml pyproject.toml tools/pip_pins.py src/moeflow/runtime/pins.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(PYTHON) tools/pip_pins.py envs/$(STACK).yaml > $(VENV)/requirements.txt
	$(BIN)/python -m pip install --quiet -r $(VENV)/requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

env: $(VENV)/.installed

train: env
	STACK=$(STACK) $(BIN)/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS) train

paper: env
	STACK=$(STACK) $(BIN)/snakemake --cores $(CORES) $(SNAKEMAKE_ARGS) paper

test: env
	STACK=$(STACK) $(BIN)/python -m pytest -m "not full" $(PYTEST_ARGS)

test-all: env
	STACK=$(STACK) $(BIN)/python -m pytest $(PYTEST_ARGS)

lint: env
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	STACK=$(STACK) $(BIN)/snakemake --lint

format: env
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# On a machine with one GPU: the stack, the smoke pipeline on cuda, moeflow vs the HF Trainer on a
# Qwen3-30B-A3B-shaped slice -> results/bench/gpu_acceptance.json (benchmarks/gpu_acceptance.sh)
gpu-check:
	STACK=$(STACK) benchmarks/gpu_acceptance.sh

# The lent GPU machine (no network) needs its missing packages as wheels carried with the tree: .device-bundle/
# (benchmarks/device_bundle.py; under 64 MiB). There: benchmarks/gpu_acceptance.sh --bundle (docs/gpu.md).
gpu-bundle: env
	$(BIN)/python benchmarks/device_bundle.py

# The CPU mimic of that machine for benchmarks/gpu_acceptance.sh --dry: Python 3.12 with its torch and transformers
# and nothing it lacks (envs/device.txt), in .venvs/device; rebuilt when envs/device.txt changes.
DEVICE_PYTHON ?= $(shell for p in python3.12 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12*/bin/python3.12; do \
  $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
.venvs/device/.installed: envs/device.txt
	@test -n "$(DEVICE_PYTHON)" || { echo "device-env needs a Python 3.12 (python3.12 on PATH, or DEVICE_PYTHON=...)"; exit 1; }
	rm -rf .venvs/device
	$(DEVICE_PYTHON) -m venv .venvs/device
	.venvs/device/bin/python -m pip install --quiet -r envs/device.txt
	touch $@

device-env: .venvs/device/.installed

# The serving environment (envs/serve.txt) for rule serve_check (config/serve.yaml): vLLM's CPU build, whose pins differ
# from both stacks'. pip pulls CUDA builds of torchvision, torchaudio and torchcodec with it, which break
# `import transformers` beside torch's CPU build; nothing here needs them.
.venvs/serve/.installed: envs/serve.txt
	rm -rf .venvs/serve
	$(PYTHON) -m venv .venvs/serve
	.venvs/serve/bin/python -m pip install --quiet --upgrade pip
	.venvs/serve/bin/python -m pip install --quiet -r envs/serve.txt
	.venvs/serve/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

serve-env: .venvs/serve/.installed

# A real SLURM on this machine (as root; Debian's packages installed if missing): this machine as one node, in the
# profiles' partitions (cpu, gpu), daemons in .slurm/ (tests/slurm_cluster.py, what tests/pipeline/test_slurm.py uses).
slurm-up:
	$(PYTHON) tests/slurm_cluster.py up .slurm

slurm-down:
	$(PYTHON) tests/slurm_cluster.py down .slurm

clean:
	rm -rf results/pinned results/current .snakemake
