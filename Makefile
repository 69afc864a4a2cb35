# kvcache developer entry points. Every target works on a fresh machine:
# `make install` creates .venv with the build/test tools and the vLLM 0.33.0 oracle.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
export VIRTUAL_ENV := $(abspath $(VENV))
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install build build-dev test test-rust test-py bench bench-rust bench-py replay lint fmt wheel clean miri fuzz memory

install: $(VENV)/.installed

$(VENV)/.installed: requirements/dev.txt requirements/oracle.txt requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c requirements/constraints.txt -r requirements/dev.txt -r requirements/oracle.txt
	$(PY) -m pip install -q --no-deps vllm==0.33.0
	touch $@

# Optimised build of the extension into .venv, with the invariant checks (`validate()`) the
# tests call (what tests and benchmarks use; release wheels leave them out).
build: install
	$(VENV)/bin/maturin develop --release -q --features validate

# Faster unoptimised build for iterating.
build-dev: install
	$(VENV)/bin/maturin develop -q --features validate

wheel: install
	$(VENV)/bin/maturin build --release -o dist

test: build test-rust test-py

test-rust:
	cargo test --workspace -q

test-py: build
	$(PY) -m pytest -q

bench: bench-rust bench-py

bench-rust:
	cargo bench -p kvcache-core

bench-py: build
	@mkdir -p .benchmarks
	$(PY) -m pytest bench -q -p no:cacheprovider --benchmark-enable --benchmark-only --benchmark-columns=min,median,rounds --benchmark-json=.benchmarks/policies.json
	$(PY) bench/summarize.py .benchmarks/policies.json

# Memory per resident chunk, ours vs vLLM's (fresh process per row).
memory: build
	$(PY) bench/memory_per_chunk.py

# The core's policy and manager tests under Miri (needs the nightly toolchain with miri; the
# host-memory module and the long property tests are left out: mmap is FFI, proptest is slow).
miri:
	cargo +nightly miri test -p kvcache-core --lib -- slab:: key:: arc::tests lru::tests manager::

# Fuzz both policies, then the manager over both (needs cargo-fuzz and nightly);
# FUZZ_SECONDS bounds each target's run.
FUZZ_SECONDS ?= 300
fuzz:
	cd fuzz && cargo +nightly fuzz run policies -- -max_total_time=$(FUZZ_SECONDS)
	cd fuzz && cargo +nightly fuzz run manager -- -max_total_time=$(FUZZ_SECONDS)

# The main job: replay the built-in synthetic multi-turn workload through LRU and ARC.
replay: build
	$(PY) -m kvcache replay

lint: install
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -q -- -D warnings
	$(VENV)/bin/ruff check python tests bench
	$(VENV)/bin/ruff format --check python tests bench

fmt: install
	cargo fmt --all
	$(VENV)/bin/ruff format python tests bench
	$(VENV)/bin/ruff check --fix python tests bench

clean:
	cargo clean
	rm -rf $(VENV) dist .pytest_cache .hypothesis .benchmarks
