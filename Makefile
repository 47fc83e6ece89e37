# Quickstart: `make train` and `make test` each set up .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: help setup train test test-fast lint format bench bench-plots bench-zero bench-reductions bench-optimizers bench-dcn device-wheels clean

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-11s %s\n", $$1, $$2}'

setup: $(STAMP)  ## the virtual environment .venv, with the test and lint tools

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

train: $(STAMP)  ## the default training job on 8 simulated CPU devices (ARGS=overrides)
	$(PY) -m trainers.train $(ARGS)

# Two pytest-xdist workers, a test file each at a time (module fixtures are built once); CI
# machines have 2 cores. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_XDIST   := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

test: $(STAMP)  ## every test (about 25 minutes on 2 cores; the 25 slowest listed at the end)
	$(PY) -m pytest $(PYTEST_XDIST) --durations=25 $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the tests not marked slow (no CLI runs in subprocesses)
	$(PY) -m pytest $(PYTEST_XDIST) -m 'not slow' $(PYTEST_ARGS)

# The checks .ci/run makes before the tests: style, formatting, types, the import layering.
LINTED := xshard trainers tests benchmarks examples hydra_plugins conf
lint: $(STAMP)  ## ruff, ruff format --check, mypy, and the import contract (lint-imports)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

format: $(STAMP)  ## ruff's fixes and formatting, in place
	$(VENV)/bin/ruff check --fix $(LINTED)
	$(VENV)/bin/ruff format $(LINTED)

bench: $(STAMP)  ## the benchmarks (benchmarks/*_results.*: step, ZeRO, precision, cache, population, reductions, optimizers)
	$(PY) -m benchmarks.run $(ARGS)
	$(PY) -m benchmarks.zero $(ZERO_ARGS)
	$(PY) -m benchmarks.precision_memory
	$(PY) -m benchmarks.compile_cache
	$(PY) -m benchmarks.population
	$(PY) -m benchmarks.reductions
	$(PY) -m benchmarks.optimizer_quality
	$(PY) -m benchmarks.plots

# The figures beside the results (benchmarks/*.png), redrawn from the JSON files; measures nothing.
bench-plots: $(STAMP)  ## redraw the benchmark figures from the results files
	$(PY) -m benchmarks.plots

# Per-axis reductions (local SGD, DiLoCo, int8) on mesh=cpu2x4_slices: bytes per axis from the
# compiled programs, tiny_gpt quality over 3 seeds, step times (benchmarks/reductions_results.md).
bench-reductions: $(STAMP)  ## the per-axis reductions benchmark only
	$(PY) -m benchmarks.reductions

# adamw, muon, schedule_free_adamw and adopt at the CLI's defaults on tiny_gpt: final train and
# eval loss over 3 seeds, ms per update (benchmarks/optimizers_results.md).
bench-optimizers: $(STAMP)  ## the optimizers' quality benchmark only
	$(PY) -m benchmarks.optimizer_quality

# DiLoCo's wall-clock on an emulated slow link: the two slices of cpu2x4_slices as two processes
# in network namespaces joined by a tbf-limited veth pair (root; benchmarks/dcn_results.md).
bench-dcn: $(STAMP)  ## time per step and utilisation per link rate and reduction (root)
	$(PY) -m benchmarks.dcn $(ARGS)

# ZeRO / FSDP against replicated: memory, collectives, step time (benchmarks/zero_results.md).
bench-zero: $(STAMP)  ## ZeRO / FSDP against replicated only
	$(PY) -m benchmarks.zero $(ZERO_ARGS)

clean:  ## remove .venv and every output
	rm -rf $(VENV) outputs multirun build *.egg-info

# The wheels benchmarks/device_check.sh installs on an accelerator host without network (the
# dependencies such a host lacks), for each Python it may have; not committed. antlr4 4.9.3 has
# no wheel on PyPI: it is built here (pure Python), and the others resolve against it.
DEVICE_WHEELS   := hydra-core omegaconf tensorboardX crc32c grain
DEVICE_PYTHONS  ?= 3.10 3.11 3.12 3.13
DEVICE_PLATFORM ?= --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
device-wheels: $(STAMP)  ## download the wheels benchmarks/device_check.sh installs offline
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir benchmarks/wheels antlr4-python3-runtime==4.9.3
	for v in $(DEVICE_PYTHONS); do \
		$(PY) -m pip download --quiet --dest benchmarks/wheels --find-links benchmarks/wheels \
			--only-binary=:all: --python-version $$v $(DEVICE_PLATFORM) $(DEVICE_WHEELS) \
			|| exit 1; \
	done
