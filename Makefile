# CPU development setup: a local .venv with everything the demo and the tests need (scripts/setup_env.sh).
#
#   make demo   # set up .venv if needed, then the SFT -> GRPO -> evaluation demo (scripts/demo.sh)
#   make test   # set up .venv if needed, then the whole test suite
#
# PYTEST_ARGS passes options to pytest (make test PYTEST_ARGS="-x tests/test_loss.py"). GPU users install
# by hand instead (README.md, "Install").

VENV ?= .venv
PYTHON ?= python3
RUN := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.PHONY: setup demo test

setup:
	VENV="$(abspath $(VENV))" PYTHON="$(PYTHON)" bash scripts/setup_env.sh

demo: setup
	$(RUN) bash scripts/demo.sh

test: setup
	$(RUN) python -m pytest -q $(PYTEST_ARGS)
