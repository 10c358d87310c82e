# The two entry points (see README Quickstart); each sets everything up first and is idempotent.
#   make run    the main job on the embedded defaults
#   make test   the whole test suite (what .ci/run calls)
# plus make demo: the main job cut to three cycles (a few minutes), for a first look.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.rtrl-installed

.PHONY: setup run demo test test-fast lint bench docs clean

setup: $(STAMP)

# torch first, pinned: anything depending on torch would otherwise pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(PY) -m pip install --quiet --disable-pip-version-check torch==2.13.0
# setuptools warns on every editable install that a folder named like a package may shadow it (ours are the
# packages); the import check runs under rtrl's own narrow filter of the warnings nobody can act on.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(PY) -c "from rtrl.quiet import quiet_known_warnings as q; q(); \
	  import torch, megatron.core, bytewax, confluent_kafka, chdb, clickhouse_connect, apache_beam, msgspec"
	@touch $(STAMP)

run: setup
	$(VENV)/bin/rtrl run

# The main job in three short cycles (deploy/demo.toml): a first look in a few minutes.
demo: setup
	$(VENV)/bin/rtrl run --config deploy/demo.toml

# Lint (ruff) and types (mypy) first: a test run on code that does not pass them is wasted.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The suite in two runs on three workers (pytest-xdist; JOBS=N for another). On CI's 2 cores two workers kept the
# CPU 74% busy: many tests wait on real time (traffic rates, windows' grace), so a third worker fills the idle.
# A module with a module- or class-scoped fixture runs on one worker (tests/conftest.py), so that run happens once. Tests marked `alone` measure an effect of
# real-time speed and run after, with the machine to themselves. pytest exits 5 when it collected no tests:
# that is a failure here when both runs collected none, never a pass.
JOBS ?= 3
# the files that hold `alone` tests: collecting only them saves the second run importing every test module
ALONE_FILES = $(shell grep -l "mark.alone" tests/test_*.py)
test: lint
	@$(PY) -m pytest -n $(JOBS) --dist loadgroup --no-loadscope-reorder -m "not alone" $(PYTEST_ARGS); a=$$?; \
	$(PY) -m pytest -m alone $(or $(PYTEST_ARGS),$(ALONE_FILES)); b=$$?; \
	if [ $$a -eq 5 ] && [ $$b -eq 5 ]; then echo "FAILED: pytest collected no tests" >&2; exit 1; fi; \
	for rc in $$a $$b; do if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then exit $$rc; fi; done

# Everything not marked slow (pure logic, in-process flows, single services): under 3 minutes on 2 cores.
test-fast: setup
	@$(PY) -m pytest -n $(JOBS) --dist loadgroup -m "not slow and not alone" -x $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "FAILED: pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The reference pages under docs/reference/ (and the diagram) regenerated from the code; tests/test_docs_current.py
# fails when they are stale.
docs: setup
	$(PY) -m docs.generate

bench: setup
	$(PY) bench/sdk_produce.py
	$(PY) bench/reward_flow.py
	$(PY) bench/trainer_input.py
	$(PY) bench/loop.py
	$(PY) bench/ab_stats.py
	$(PY) bench/backfill.py
	$(PY) bench/spill_state.py
	$(PY) bench/long_loop.py
	$(PY) bench/adapters.py
	$(PY) bench/per_org.py

clean:
	rm -rf $(VENV) .rtrl .pytest_cache .hypothesis
