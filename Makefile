# The two commands of the README's Quickstart: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled

.PHONY: install kernels bytecode serve test clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU path: pin torch so pip takes the CPU wheel instead of a multi-GB CUDA build.
	$(BIN)/python -m pip install -q --no-compile "torch==2.13.0"
	$(BIN)/python -m pip install -q --no-compile -e ".[dev]"
	# The bytecode pip would have written, on every core rather than one file at a time
	# (the install 137 s -> 97 s here). Never skip it: PYTHONDONTWRITEBYTECODE, set on
	# these machines, leaves every process compiling torch and ray afresh. A file for a
	# newer Python does not compile (torch ships one) and is skipped, as pip skips it.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

install: $(STAMP)

# Compile the C++ CPU kernels once (cached under ~/.cache/torch_extensions; seconds
# when already built), so that no worker or test pays for it; never fails: a kernel
# that does not build falls back to its torch reference.
kernels: $(STAMP)
	$(BIN)/python -m kernels.cpu_build

# The project's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on
# these machines) no import writes it, and every process, each Ray worker's, compiled the
# project afresh (cluster.app's own imports: 1.0 s of CPU from source, 0.67 s from bytecode).
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q actors cluster kernels benchmarks

serve: kernels bytecode
	$(BIN)/tandem check-manifest --local manifests/local.yaml
	$(BIN)/serve run manifests/local.yaml

# Two workers: the tests on a Ray cluster on one, first and one after another; each other
# file on the other meanwhile (tests/conftest.py, pytest_collection_modifyitems).
test: kernels bytecode
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --no-loadscope-reorder --durations=30 tests

clean:
	rm -rf $(VENV) .pytest_cache
