# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: setup system-deps demo test lint bench conformance

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
	$(BIN)/mypy

test: setup system-deps lint
	$(BIN)/pytest

# Every plane, with a published report per plane and version, and the matrix made from them.
conformance: setup system-deps
	$(BIN)/conformance run --plane all --report-yaml conformance/reports
	$(BIN)/conformance parity conformance/reports --out docs/parity.md

bench: setup system-deps
	$(BIN)/python -m bench
