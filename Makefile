# All set-up happens here: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint typecheck pytest bench bench-health-rules health-false-alarms gpu-check docs docs-serve sysdeps clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10) and "Python >= 3.10 is required")'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@$(MAKE) --no-print-directory sysdeps
	touch $(STAMP)

# Graphviz's `dot` renders execution graphs to SVG/PNG. Installed from the system's
# packages where possible; without it DOT and JSON export still work.
sysdeps:
	@if command -v dot >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing graphviz (dot) from the system's packages"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
			|| echo "warning: could not install graphviz; rendering to SVG/PNG will be unavailable"; \
	else \
		echo "note: graphviz 'dot' not found; install it (e.g. 'apt-get install graphviz') to render graphs"; \
	fi

demo: $(STAMP)
	$(PY) examples/tensorboard_stats.py --out lightning_logs

lint: $(STAMP)
	$(PY) -m ruff check lightning_recorder tests examples benchmarks
	$(PY) -m ruff format --check lightning_recorder tests examples benchmarks

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -n 2 --doctest-modules tests lightning_recorder $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) benchmarks/run.py

# What HealthMonitor's rules and view add to the FeatureStatsMonitor's steps (also in `make bench`).
bench-health-rules: $(STAMP)
	$(PY) benchmarks/bench_health_rules.py

# HealthMonitor's rule alerts on three healthy runs of 10,000 steps each, at default thresholds
# (six trainings, about half an hour on one core; not part of `make bench`).
health-false-alarms: $(STAMP)
	$(PY) benchmarks/health_false_alarms.py

# The GPU checks in one command, on a machine with a CUDA device: tests/gpu, then
# benchmarks/bench_gpu.py, its profile of a logging step and bench_health.py; results in $$OUT (default: a new temporary folder). No set-up step: it
# runs $$PYTHON (default: .venv/bin/python if there is one, else python3) on this checkout, so
# that a GPU machine without network access can run it. See docs/benchmarks.md, "GPU".
gpu-check:
	bash benchmarks/gpu_check.sh

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache lightning_logs
