# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: setup system-deps demo test lint bench conformance fuzz soak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,asgi,bench]' smg vllm-router
	touch $@

setup: $(VENV)/.installed

# etcd (Debian's etcd-server) for the discovery tests; a fresh machine has an empty apt list.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { apt-get update && apt-get install -y etcd-server; }
	@command -v wrk >/dev/null 2>&1 || { apt-get update && apt-get install -y wrk; }

demo: setup
	$(BIN)/router demo

lint: setup
	$(BIN)/ruff check router conformance tests bench
	$(BIN)/ruff format --check router conformance tests bench
	$(BIN)/mypy

# CI runs two planes (python, smg); the vllm-router plane runs in `make conformance` (and
# its whole-suite test under a plain `pytest`): all three (`conformance run --plane all`)
# took 115-186 s of wall time (144-162 CPU-s) on a shared, loaded 2-core machine, not
# reliably under the two minutes a CI run may give them.
test: setup system-deps lint
	$(BIN)/pytest -m "not vllm_router"

# Every plane, with a published report per plane and version, and the matrix made from them.
conformance: setup system-deps
	$(BIN)/conformance run --plane all --report-yaml conformance/reports
	$(BIN)/conformance parity conformance/reports --out docs/parity.md

bench: setup system-deps
	$(BIN)/python -m bench

# The long adversarial runs; the suite runs short versions of both. Bounded in count and time.
fuzz: setup system-deps
	ROUTER_FUZZ_EXAMPLES=10000 timeout 3600 $(BIN)/pytest -q -p no:cacheprovider -o faulthandler_timeout=0 tests/adversarial -k fuzz

soak: setup system-deps
	timeout 600 $(BIN)/python -m tests.adversarial.soak --duration-s 60 --streams 1000
