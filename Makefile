# elastic-rl: `make run` and `make test` are the two set-up commands (see README).
# Both create .venv, install the project with the CPU build of torch, install
# etcd if it is missing, then run. Re-running is fast: the install is redone
# only when pyproject.toml or this Makefile changes.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_VERSION := 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed

.PHONY: setup run demo test chaos etcd clean

setup: $(INSTALLED) etcd

$(INSTALLED): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# The CPU torch first and pinned: an unpinned torch pulls gigabytes of CUDA wheels.
	$(PY) -m pip install --quiet --disable-pip-version-check torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

etcd:
	@command -v etcd >/dev/null 2>&1 || scripts/install-etcd.sh

# The tiny GRPO job under erld, in a fresh work dir each time.
run: setup
	$(VENV)/bin/erl run examples/tiny-grpo.yaml --workdir runs/tiny-grpo-$$(date +%Y%m%d-%H%M%S)

# The model and engine stack alone: export, two cpu engines, the router, generations.
demo: setup
	$(PY) -m elastic_rl.demo examples/tiny-grpo.yaml

test: setup
	$(PY) -m pytest

# The long chaos runs, each checked against a fault-free run: five rounds of random kills of job
# processes and erld, and replica kills with three replicas and with tensor-parallel replicas.
chaos: setup
	$(PY) -m pytest -m chaos tests/integration/test_resume.py tests/integration/test_replicas.py

clean:
	rm -rf $(VENV) runs .pytest_cache
