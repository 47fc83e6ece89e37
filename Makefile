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

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m 'not slow' $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.run $(ARGS)
	$(PY) -m benchmarks.zero $(ZERO_ARGS)

# ZeRO / FSDP against replicated: memory, collectives, step time (benchmarks/zero_results.md).
bench-zero: $(STAMP)
	$(PY) -m benchmarks.zero $(ZERO_ARGS)

clean:
	rm -rf $(VENV) outputs multirun build *.egg-info
