# Quickstart: `make train` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test test-fast bench bench-zero clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m trainers.train $(ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures are built once); CI
# machines have 2 cores. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST   := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_XDIST) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest $(PYTEST_XDIST) -m 'not slow' $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run $(ARGS)
	$(PY) -m benchmarks.zero $(ZERO_ARGS)

# ZeRO / FSDP against replicated: memory, collectives, step time (benchmarks/zero_results.md).
bench-zero: $(STAMP)
	$(PY) -m benchmarks.zero $(ZERO_ARGS)

clean:
	rm -rf $(VENV) outputs multirun build *.egg-info
