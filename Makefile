# CPU development setup: a local .venv with everything the demo and the tests need (scripts/setup_env.sh).
#
#   make demo   # set up .venv if needed, then the SFT -> GRPO -> evaluation demo (scripts/demo.sh)
#   make demo-multi-turn   # the same for tool use: GRPO teaches the calculator (scripts/demo_multi_turn.sh)
#   make test   # set up .venv if needed, then the whole test suite
#
# PYTEST_ARGS passes options to pytest (make test PYTEST_ARGS="-x tests/test_loss.py"; "-n 0" for one
# process). GPU users install
# by hand instead (README.md, "Install").

VENV ?= .venv
PYTHON ?= python3
RUN := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.PHONY: setup demo demo-multi-turn test

setup:
	VENV="$(abspath $(VENV))" PYTHON="$(PYTHON)" bash scripts/setup_env.sh

demo: setup
	$(RUN) bash scripts/demo.sh

demo-multi-turn: setup
	$(RUN) bash scripts/demo_multi_turn.sh

# -n auto: one pytest worker per core; --dist loadfile keeps each test file on one worker, so module-scoped
# fixtures (a vLLM engine, a converted model) are built once; --no-loadscope-reorder hands files out in the order
# tests/conftest.py gives them, longest first (xdist's default order, most tests first, started the
# one-test learning file last).
test: setup
	$(RUN) python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
