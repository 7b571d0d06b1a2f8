# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: setup system-deps demo test lint bench conformance

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,asgi,bench]' smg
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
	$(BIN)/mypy

test: setup system-deps lint
	$(BIN)/pytest

conformance: setup
	$(BIN)/conformance run --plane all

bench: setup system-deps
	$(BIN)/python -m bench

# Every fuzz test of tests/adversarial with 10,000 examples each (the suite runs 200).
.PHONY: fuzz
fuzz: setup
	ROUTER_FUZZ_EXAMPLES=10000 $(BIN)/pytest -q -o faulthandler_timeout=0 tests/adversarial -k fuzz
