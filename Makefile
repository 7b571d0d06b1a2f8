# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: setup build-deps system-deps demo test test-pure pure-tree lint bench conformance fuzz soak

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The install compiles the request path with mypyc (setup.py), so it needs a C compiler
# and Python's headers; `ROUTER_PURE_PYTHON=1 make setup` builds the pure package instead.
$(VENV)/.installed: pyproject.toml setup.py | build-deps $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,asgi,bench]' smg vllm-router
	touch $@

setup: $(VENV)/.installed

# gcc and the headers of the Python that builds the venv; Debian packages only if missing.
build-deps:
	@command -v gcc >/dev/null 2>&1 || { apt-get update && apt-get install -y gcc; }
	@test -f "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" \
		|| { apt-get update && apt-get install -y python3-dev; }

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
# The whole suite on the compiled build (what users run), then the unit tests on the pure
# build. The pure build cannot share this tree: an editable compiled install leaves its
# extensions beside the sources, and Python prefers them to the .py files. So the pure
# venv installs a copy of the tree (sources only) and runs the unit tests there.
PURE_VENV := .venv-pure
PURE_TREE := build/pure-tree

test: setup system-deps lint
	$(BIN)/pytest -m "not vllm_router"
	$(MAKE) test-pure

$(PURE_VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(PURE_VENV)
	$(PURE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MAKE) pure-tree
	ROUTER_PURE_PYTHON=1 $(PURE_VENV)/bin/python -m pip install --quiet -e '$(PURE_TREE)[test,bench]'
	touch $@

# The tree's sources as they are now (tracked and new files, nothing git ignores).
pure-tree:
	rm -rf $(PURE_TREE) && mkdir -p $(PURE_TREE)
	git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C $(PURE_TREE)

test-pure: $(PURE_VENV)/.installed
	$(MAKE) pure-tree
	cd $(PURE_TREE) && ../../$(PURE_VENV)/bin/python -c 'from router.observability.metrics import BUILD; assert BUILD == "pure", BUILD'
	cd $(PURE_TREE) && ../../$(PURE_VENV)/bin/pytest -q -p no:cacheprovider tests/test_*.py

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
