# kvcache developer entry points. Every target works on a fresh machine (python3 >= 3.11 and a
# Rust toolchain): each one installs what it needs into .venv, in layers, each a stamp file:
#
#   base         build tools, numpy, tqdm: enough to build the extension and run the replay
#   quick        base + the test and lint tools (requirements/dev.txt), for `make quick`
#   wheel-tools  base + zig and auditwheel, for the manylinux wheel
#   install      everything: base, wheel tools, test and lint tools, and the two vLLM releases
#                that are the test oracles (requirements/vllm.txt: 0.34.0 in .venv, 0.33.0 in
#                .venv/oracle/vllm-0.33.0), with the CUDA build of torch: ~7 GB
#
# `make replay` (the main job) needs only the base; `make test` and `make lint` install it all;
# `make quick` (the edit loop) needs the base and the test tools, not the vLLM oracles.
# `make stress` reruns the tests that wait on threads, gates and the fake CUDA runtime pinned to
# one core (and beside CPU burners), to catch a test that races instead of waiting.
# Versions are pinned by requirements/constraints.txt. A new target depends on the layer it
# needs, adds itself to `.PHONY` and ends its rule line with `## what it does` (`make help`);
# a new lint step goes into `lint`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q -c requirements/constraints.txt
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

# The wheel's platform tag: torch's Linux wheels (and so vLLM) need glibc 2.28 already.
MANYLINUX ?= manylinux_2_28
REPLAY_ARGS ?=

# The vLLM releases (requirements/vllm.txt): the first goes into .venv, each other one into a
# directory of its own that a test pass puts first on PYTHONPATH.
VLLM_VERSIONS := $(shell sed -n 's/^vllm==//p' requirements/vllm.txt)
VLLM_MAIN     := $(firstword $(VLLM_VERSIONS))
VLLM_OTHERS   := $(wordlist 2,$(words $(VLLM_VERSIONS)),$(VLLM_VERSIONS))
ORACLE_DIR    := $(VENV)/oracle

BASE        := $(VENV)/.base-installed
WHEEL_TOOLS := $(VENV)/.wheel-tools-installed
FULL        := $(VENV)/.installed

.PHONY: help base install build build-dev wheel replay test test-rust test-py quick stress lint \
        fmt bench bench-rust bench-py memory miri fuzz clean
.DEFAULT_GOAL := help

# `make help` lists every target whose rule line ends in `## what it does`.
help: ## list the targets and what each does
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z-]*:.*## / {printf "  %-11s %s\n", $$1, $$2}' \
	  $(MAKEFILE_LIST)

# --- environments ---------------------------------------------------------------------------

base: $(BASE) ## .venv with the build tools, numpy and tqdm (what `make replay` needs)
install: $(FULL) ## .venv with everything: test and lint tools, both vLLM oracles (~7 GB)

$(BASE): requirements/base.txt requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -r requirements/base.txt
	touch $@

$(WHEEL_TOOLS): $(BASE) requirements/wheel.txt
	$(PIP) -r requirements/wheel.txt
	touch $@

# vLLM itself goes in with --no-deps: its full dependency set pulls CUDA kernels never run here;
# requirements/oracle.txt lists what its kv_offload modules import.
$(FULL): $(BASE) $(WHEEL_TOOLS) requirements/dev.txt requirements/oracle.txt requirements/vllm.txt
	$(PIP) -r requirements/dev.txt -r requirements/oracle.txt
	$(PY) -m pip install -q --no-deps vllm==$(VLLM_MAIN)
	for v in $(VLLM_OTHERS); do \
	  rm -rf $(ORACLE_DIR)/vllm-$$v && \
	  $(PY) -m pip install -q --no-deps --target $(ORACLE_DIR)/vllm-$$v vllm==$$v || exit 1; \
	done
	touch $@

# --- build ----------------------------------------------------------------------------------

# Optimised build of the extension into .venv (what the replay, tests and benchmarks use), with
# the invariant checks (`validate()`) the tests call; the distributable wheel leaves them out.
build: $(BASE) ## optimised extension into .venv, with the `validate()` checks tests call
	$(VENV)/bin/maturin develop --release -q --features validate

# Faster unoptimised build for iterating.
build-dev: $(BASE) ## unoptimised extension into .venv: faster to build, slower to run
	$(VENV)/bin/maturin develop -q --features validate

# The distributable wheel: abi3 (CPython >= 3.11), stripped, linked by zig against glibc 2.28's
# symbols; maturin refuses a wheel that is not $(MANYLINUX)-compliant, and auditwheel reports
# the tag it finds on its own.
wheel: $(WHEEL_TOOLS) ## the distributable manylinux abi3 wheel into dist/
	rm -f dist/kvcache_offload-*.whl
	$(VENV)/bin/maturin build --release --strip --zig --compatibility $(MANYLINUX) -o dist
	$(VENV)/bin/auditwheel show dist/kvcache_offload-*.whl

# --- the main job ---------------------------------------------------------------------------

# Replay the built-in synthetic multi-turn workload through LRU and ARC (REPLAY_ARGS: more
# options, e.g. REPLAY_ARGS="--compare-vllm --repeat 3" after `make install`).
replay: build ## the main job: replay the built-in workload (REPLAY_ARGS: more options)
	$(PY) -m kvcache replay $(REPLAY_ARGS)

# --- tests and lint -------------------------------------------------------------------------

test: install build test-rust test-py ## every test: cargo test, then pytest against each vLLM release

test-rust: ## cargo test of the workspace
	cargo test --workspace -q

# The whole suite against each vLLM release: first the one in .venv (with
# tests/packaging/test_wheel.py, which installs the wheel `make wheel` just built into a clean
# venv), then each other one first on PYTHONPATH (everything but the wheel test, which does not
# depend on the installed vLLM). Every release's pass runs whatever an earlier one did; the
# target then fails if any failed, after a line per release.
test-py: install build wheel ## pytest against each vLLM release, the wheel test included
	@status=""; \
	echo "--- pytest against vLLM $(VLLM_MAIN)"; \
	if KVCACHE_WHEEL="$(abspath $(wildcard dist/kvcache_offload-*.whl))" $(PY) -m pytest -q; \
	then status="$$status $(VLLM_MAIN):passed"; else status="$$status $(VLLM_MAIN):FAILED"; fi; \
	for v in $(VLLM_OTHERS); do \
	  echo "--- pytest against vLLM $$v"; \
	  if PYTHONPATH="$(abspath $(ORACLE_DIR))/vllm-$$v" $(PY) -m pytest -q \
	    --ignore=tests/packaging/test_wheel.py; \
	  then status="$$status $$v:passed"; else status="$$status $$v:FAILED"; fi; \
	done; \
	echo "--- pytest results"; \
	for r in $$status; do echo "vLLM $${r%%:*}: $${r#*:}"; done; \
	case "$$status" in *FAILED*) exit 1;; esac

# The edit loop: the tests that need no vLLM oracle, in the base layer plus the test tools
# (requirements/dev.txt), never the ~7 GB oracle install. KVCACHE_ALLOW_NO_ORACLE=1 skips what
# needs vLLM, torch or Triton when they are not installed (tests/support/no_oracle.py, listed at
# the end of the run); `slow` tests (the wheel's release build) are left out. `make test` runs
# them all.
QUICK       := $(VENV)/.quick-installed
QUICK_ARGS  ?=
$(QUICK): $(BASE) requirements/dev.txt
	$(PIP) -r requirements/dev.txt
	touch $@

quick: $(QUICK) build ## the edit loop: tests needing no vLLM oracle (~3 min; no 7 GB install)
	KVCACHE_ALLOW_NO_ORACLE=1 $(PY) -m pytest -q -p no:cacheprovider -m "not oracle and not slow" \
	  $(QUICK_ARGS)

# The tests that wait on threads, gates, background pinning and the fake CUDA runtime's
# streams, STRESS_REPEAT times pinned to one core (taskset -c 0), then STRESS_BURN_REPEAT times
# on that core beside two CPU burners the target starts and kills: a test that sleeps and
# hopes instead of waiting for the state it asserts fails here. Any failure fails the target.
# The long conformance files (test_worker_conformance.py, test_worker_kernel_conformance.py)
# are left out by default; add them through STRESS_TESTS.
STRESS_REPEAT      ?= 3
STRESS_BURN_REPEAT ?= 1
STRESS_TESTS       ?= tests/transfer/test_fakecuda.py tests/transfer/test_fakecuda_kernel.py \
  tests/transfer/test_transfer_cuda_backend.py tests/transfer/test_transfer_registration.py \
  tests/transfer/test_transfer_populate.py tests/transfer/test_transfer_pool.py \
  tests/transfer/test_transfer_engine.py tests/hostile/test_hostile_threads.py \
  tests/tiering/test_tiering_worker.py tests/tiering/test_tiering_conformance.py \
  tests/worker/test_worker_api.py tests/worker/test_worker_pointers.py \
  tests/worker/test_worker_default.py
STRESS_PYTEST      = $(PY) -m pytest -q -p no:cacheprovider $(STRESS_TESTS)
stress: install build ## the waiting tests pinned to one core, then beside CPU burners
	@set -e; \
	for i in $$(seq $(STRESS_REPEAT)); do \
	  echo "--- stress: pinned to one core, run $$i of $(STRESS_REPEAT)"; \
	  taskset -c 0 $(STRESS_PYTEST); \
	done; \
	taskset -c 0 yes >/dev/null & burner1=$$!; \
	taskset -c 0 yes >/dev/null & burner2=$$!; \
	trap 'kill $$burner1 $$burner2' EXIT; trap 'exit 130' INT TERM; \
	for i in $$(seq $(STRESS_BURN_REPEAT)); do \
	  echo "--- stress: pinned to one core beside two CPU burners, run $$i of $(STRESS_BURN_REPEAT)"; \
	  taskset -c 0 $(STRESS_PYTEST); \
	done

lint: install build ## rustfmt, clippy, ruff, mypy, stubtest, file lengths
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	cargo clippy --workspace --all-targets -q --features kvcache-py/validate -- -D warnings
	$(VENV)/bin/ruff check python tests bench gpu scripts
	$(VENV)/bin/ruff format --check python tests bench gpu scripts
	$(PY) scripts/check_file_lengths.py
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest kvcache._core --allowlist python/stubtest-allowlist.txt

fmt: install ## format Rust and Python, apply ruff's fixes
	cargo fmt --all
	$(VENV)/bin/ruff format python tests bench gpu scripts
	$(VENV)/bin/ruff check --fix python tests bench gpu scripts

# --- benchmarks and deeper checks -------------------------------------------------------------

bench: bench-rust bench-py ## both benchmark suites

bench-rust: ## criterion benchmarks of the core
	cargo bench -p kvcache-core

bench-py: install build ## pytest-benchmark, kvcache side by side with vLLM
	@mkdir -p .benchmarks
	$(PY) -m pytest bench -q -p no:cacheprovider --benchmark-enable --benchmark-only --benchmark-columns=min,median,rounds --benchmark-json=.benchmarks/policies.json
	$(PY) bench/summarize.py .benchmarks/policies.json

# Memory per resident chunk, ours vs vLLM's (fresh process per row).
memory: install build ## memory per resident chunk, kvcache vs vLLM
	$(PY) bench/memory_per_chunk.py

# The core's policy and manager tests under Miri (needs the nightly toolchain with miri; the
# host-memory module and the long property tests are left out: mmap is FFI, proptest is slow).
miri: ## the core's policy and manager tests under Miri (nightly)
	cargo +nightly miri test -p kvcache-core --lib -- slab:: key:: arc::tests lru::tests manager::

# Fuzz both policies, then the manager over both (needs cargo-fuzz and nightly);
# FUZZ_SECONDS bounds each target's run.
FUZZ_SECONDS ?= 300
fuzz: ## both cargo-fuzz targets, FUZZ_SECONDS each (nightly, cargo-fuzz)
	cd fuzz && cargo +nightly fuzz run policies -- -max_total_time=$(FUZZ_SECONDS)
	cd fuzz && cargo +nightly fuzz run manager -- -max_total_time=$(FUZZ_SECONDS)

clean: ## remove .venv, build outputs and caches
	cargo clean
	rm -rf $(VENV) dist .pytest_cache .hypothesis .benchmarks
