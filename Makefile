# The targets the README names. Each sets up .venv itself (scripts/bootstrap.sh) when needed.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test test-fast lint typecheck bench clean
venv:
	@bash scripts/bootstrap.sh

demo: venv  ## the main job: tiny model -> vLLM -> Zarr store -> checksums, under Prefect (no server)
	@$(VENV)/bin/hsx demo

lint: venv
	@$(VENV)/bin/ruff check hsx settings tasks flows tests bench scripts
	@$(VENV)/bin/ruff format --check hsx settings tasks flows tests bench scripts

typecheck: venv
	@$(VENV)/bin/mypy

test:  ## everything CI runs (environment, lint, types, the suite on 3.11, unit tests on 3.12), timed
	@bash scripts/test-all.sh

test-py%:  ## unit tests under another Python, e.g. make test-py3.13
	@bash scripts/unit-tests-on.sh $*

test-fast: venv  ## unit tests only (no engine, no Prefect)
	@$(PY) -m pytest tests/unit -q

bench: venv
	@$(PY) bench/bench_extract.py

clean:
	rm -rf stores/ .pytest_cache .mypy_cache .ruff_cache
