#!/usr/bin/env bash
# The whole GPU check in one command, for a bare GPU machine with no network (docs/gpu.md):
#
#   bash scripts/gpu_check.sh [--wheels DIR | --no-wheels] [--out DIR] [--budget SECONDS]   # on a GPU
#   bash scripts/gpu_check.sh --device cpu --tiny --wheels DIR --out DIR           # its CPU rehearsal
#   bash scripts/gpu_check.sh --device cpu --tiny --fork-stages ...               # the same, imports shared
#   bash scripts/gpu_check.sh --stages install,env,ablation                      # only these stages
#
# 1. installs the carried wheels (DIR, default .whl/: scripts/gpu_wheels.py downloads them) with
#    `pip install --no-index --no-deps --target SITE`, SITE a fresh temporary directory put on PYTHONPATH
#    (after this checkout and its recipes/); with no wheels, the interpreter's own packages are used;
# 2. env: the device and every package's version and origin (scripts/gpu_report.py env);
# 3. tests: the GPU test set, pytest -m gpu tests/test_gpu.py --device DEVICE (JUnit XML with their figures);
# 3b. ablation: benchmarks/gpu_ablation.py, the update with each switch alone and all together on the 0.6B
#    and 1.7B shapes (what each computes against the baseline, tokens/s, MFU, peak memory), variants that
#    would start past its share skipped and listed;
# 4. grpo_0_6b: benchmarks/gpu_grpo.py on the Qwen3-0.6B shape: ceilings, decode, one GRPO step, the recipe;
# 5. trl: benchmarks/gpu_trl.py, TRL's GRPOTrainer on the same model and batch (the step-time ratio);
# 6. qwen3_5: benchmarks/gpu_qwen3_5.py, the transformers backend (Qwen3.5 is not a torchtune architecture)
#    on a Qwen3.5-0.8B-shaped random model (shared-prompt rows, its Gated DeltaNet layers split by sequence),
#    then on Gemma 3 1B's shape (shared-prompt rows on transformers' modules), and TRL on the Qwen3.5 model and
#    batch (the step-time ratio); the report says which training layout and engine path each run used;
#    skipped, with the reason in the report, where the installed transformers has no qwen3_5;
# 6a. backends: benchmarks/gpu_backends.py, the recipe on the Qwen3-0.6B shape with each policy backend (torchtune's
#    modules, transformers' own module): the step, generation and training ratios, each run's layout and engine path;
# 6b. moe: benchmarks/gpu_moe.py, a mixture of experts (Qwen3-30B-A3B's layout, 2 of its 48 layers) through the
#    transformers backend, and TRL on the same model and batch (step time and peak memory), beside the paper
#    estimate of our peak (benchmarks/moe_memory.py);
# 7. grpo_1_7b: benchmarks/gpu_grpo.py on the Qwen3-1.7B shape: the reference model per mode, the recipe and
#    decode, in the time left;
# 8. the report: OUT/gpu_check.json and OUT/gpu_check.md (rewritten after every stage, so a check cut
#    short still leaves what it measured).
#
# Each stage runs under `timeout` within the budget (default 540 s: 9 minutes, inside the 10 minutes a
# command may take on the lent machines; the shares are calibrated on the first real run, one H200 on
# 2026-11-26, docs/gpu.md); a stage past its share is stopped and reported, and the next one runs. --tiny: tiny shapes for the CPU rehearsal (tests/test_gpu_check.py runs it in the CPU suite).
# --fork-stages: the Python stages are forked from one process that imported torch, torchtune, transformers and
# TRL once (scripts/fork_stages.py), instead of each importing them (~7 s a stage on a CPU); the rehearsal uses it.
# Exit status 0 only when every stage exited 0, every GPU test passed and no benchmark part raised.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$REPO/.whl"
OUT_DIR="$REPO/gpu_check_out"
DEVICE=cuda
TINY=()
BUDGET=540
STAGES=all
FORK_STAGES=false
PYTHON="${PYTHON:-python3}"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --wheels) WHEELS="$2"; shift 2 ;;
    --no-wheels) WHEELS=""; shift ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=(--tiny); shift ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --stages) STAGES="$2"; shift 2 ;;
    --fork-stages) FORK_STAGES=true; shift ;;
    *) echo "unknown argument: $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done

mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
rm -f "$OUT_DIR"/{stages.jsonl,env.json,gpu_tests.xml,grpo_*.json,trl.json,ablation.json,qwen3_5.json,backends.json,moe.json,gpu_check.json,gpu_check.md,*.log}
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
cd "$REPO"

# A stage: NAME SHARE(seconds, capped by what is left of the budget) COMMAND... ; its output goes to
# OUT/NAME.log and the terminal, its exit status and duration to OUT/stages.jsonl.
stage() {
  local name="$1" share="$2"; shift 2
  if [[ "$STAGES" != all && ",$STAGES," != *",$name,"* ]]; then
    return  # not asked for (--stages): not run, not reported
  fi
  local left=$(( BUDGET - (SECONDS - START) ))
  (( share > left )) && share=$left
  if (( share < 10 )); then
    echo "{\"name\": \"$name\", \"rc\": 0, \"seconds\": 0, \"skipped\": \"no time left\"}" >> "$OUT_DIR/stages.jsonl"
    echo "=== $name: skipped, no time left of the ${BUDGET} s budget"
    return
  fi
  echo "=== $name (at most ${share} s)"
  local t0=$SECONDS rc
  timeout --kill-after=15 "$share" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  rc=${PIPESTATUS[0]}
  local timed_out=false
  (( rc == 124 || rc == 137 )) && timed_out=true
  echo "{\"name\": \"$name\", \"rc\": $rc, \"seconds\": $(( SECONDS - t0 )), \"timed_out\": $timed_out}" >> "$OUT_DIR/stages.jsonl"
  "$PYTHON" scripts/gpu_report.py report "$OUT_DIR" > /dev/null
}

# 1. the carried wheels
SITE="$WORK/site"
shopt -s nullglob
wheels=()
[[ -n "$WHEELS" ]] && wheels=("$WHEELS"/*.whl)
if (( ${#wheels[@]} )); then
  stage install 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
else
  echo "no wheels${WHEELS:+ in $WHEELS}: using the interpreter's own packages"
fi
export PYTHONPATH="$REPO:$REPO/recipes:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODELS="$WORK/models"
# The interpreter of the stages (what `python` is in them): $PYTHON, or a child of the fork server.
PY=("$PYTHON")
if [[ "$FORK_STAGES" == true ]]; then
  # vLLM hidden as on the GPU machine, which has none (TRL imports the CPU build this environment has: ~7 s).
  # The compiler's modules too (dynamo, AOT autograd, the inductor package, the sympy and networkx parts they load):
  # the stages that compile (tests, ablation, grpo_0_6b) would each import them at their first compile (~0.9 s).
  "$PYTHON" scripts/fork_stages.py serve "$WORK/stages.sock" --hide vllm torch torchtune torchtune_grpo \
    transformers trl peft datasets omegaconf grpo_full_finetune_distributed torch._dynamo torch._functorch.aot_autograd \
    torch._inductor functorch.compile torch.export networkx sympy.assumptions sympy.combinatorics &
  FORK_SERVER=$!
  trap 'kill "$FORK_SERVER" 2>/dev/null; wait "$FORK_SERVER" 2>/dev/null; rm -rf "$WORK"' EXIT
  PY=("$PYTHON" scripts/fork_stages.py run "$WORK/stages.sock")
  # The process a GPU test starts for one measurement (the logprob memory's peak RSS, tests/test_gpu.py): a child
  # of the fork server too, not a fresh interpreter (~3.5 s of imports). Without --fork-stages: the test's python.
  GPU_CHECK_PYTHON="$(printf '%q ' "${PY[@]}")"
  export GPU_CHECK_PYTHON
fi

# 2-7
stage env 60 "${PY[@]}" scripts/gpu_report.py env "$OUT_DIR"
# 8 tests took 81 s on the H200; 3 more since (a generation worker on the device, session compaction,
# FlexAttention's compile): 180 s, taken from the 1.7B stage's remainder.
stage tests 180 "${PY[@]}" -m pytest -q -p no:cacheprovider -n 0 -m gpu --device "$DEVICE" \
  --junitxml "$OUT_DIR/gpu_tests.xml" tests/test_gpu.py
# The ablation (docs/gpu.md, "The update switches") decides the CUDA defaults, so it runs before the
# benchmarks already measured once: 240 s of the default plan (its own budget stops starting variants 50 s
# before, so the variant under way can finish), or what is left when it runs with fewer stages (--stages).
ABLATION_SHARE=240
[[ "$STAGES" != all ]] && ABLATION_SHARE=$(( BUDGET - (SECONDS - START) ))
if (( ${#TINY[@]} )); then  # the CPU rehearsal: the tiny shape, the baseline, the bf16 head and all switches
  stage ablation 120 "${PY[@]}" benchmarks/gpu_ablation.py --device "$DEVICE" --tiny --model-dir "$MODELS" \
    --variants baseline bf16_head all --json "$OUT_DIR/ablation.json"
else
  stage ablation "$ABLATION_SHARE" "${PY[@]}" benchmarks/gpu_ablation.py --device "$DEVICE" --model-dir "$MODELS" \
    --models qwen3_0_6b qwen3_1_7b --variants baseline all bf16_head no_ac compiled tf32 selective_ac auto_ac \
    --steps 1 --json "$OUT_DIR/ablation.json" --time-budget $(( ABLATION_SHARE - 50 ))
fi
GRPO=("${PY[@]}" benchmarks/gpu_grpo.py --device "$DEVICE" "${TINY[@]}" --model-dir "$MODELS")
# Measured on an H200: the recipe's 3 steps 72 s (the first, compiling the decode step, 50 s); each
# compiled decode shape 43 s (40 s of it compiling); TRL 53 s of training for 2 steps (+15 s loading).
# The recipe and TRL come first: they are the step-time ratio; decode and the component step follow.
stage grpo_0_6b 180 "${GRPO[@]}" --models qwen3_0_6b --parts ceilings recipe decode grpo --recipe-steps 3 \
  --decode-compile on --repeats 2 --json "$OUT_DIR/grpo_0_6b.json" --time-budget 125
stage trl 100 "${PY[@]}" benchmarks/gpu_trl.py --device "$DEVICE" "${TINY[@]}" --model qwen3_0_6b \
  --model-dir "$MODELS" --steps 1 --json "$OUT_DIR/trl.json"
# Not yet run on a GPU: 16 prompts x 8 (half the Qwen3 stages' batch, the same on both sides), our recipe's
# 2 steps (one measured) then TRL's 2 (one measured) if 120 s have not gone on ours.
stage qwen3_5 200 "${PY[@]}" benchmarks/gpu_qwen3_5.py --device "$DEVICE" "${TINY[@]}" --model-dir "$MODELS" \
  --prompts 16 --json "$OUT_DIR/qwen3_5.json" --time-budget 120
# Not yet run on a GPU: the recipe on the Qwen3-0.6B shape with each policy backend (torchtune's modules, then
# transformers' own Qwen3 module, the module of every 2026 family), the qwen3_5 stage's workload, 3 steps each
# (two measured); the ratios transformers / torchtune and each run's layout and engine path.
stage backends 200 "${PY[@]}" benchmarks/gpu_backends.py --device "$DEVICE" "${TINY[@]}" --model-dir "$MODELS" \
  --prompts 16 --recipe-steps 3 --json "$OUT_DIR/backends.json"
# Not yet run on a GPU: the same batch on the 1.87B mixture of experts (an estimated 60-120 s for our 2 steps,
# as long again for TRL's, which is skipped if 130 s have gone on ours). Like qwen3_5, likely skipped for time in
# the default plan: `--stages install,env,moe` runs it alone.
stage moe 240 "${PY[@]}" benchmarks/gpu_moe.py --device "$DEVICE" "${TINY[@]}" --model-dir "$MODELS" \
  --json "$OUT_DIR/moe.json" --time-budget 130
if (( ${#TINY[@]} )); then  # the second shape is the same tiny model: rehearse the stage, not the parts again
  stage grpo_1_7b 120 "${GRPO[@]}" --models qwen3_1_7b --parts reference recipe --json "$OUT_DIR/grpo_1_7b.json"
else
  # What is left of the budget (~100 s): the reference model's memory per mode (full, int8, NF4, offloaded:
  # an estimated 20-40 s, not yet run on a GPU), the recipe's 2 steps (one measured), then the compiled decode
  # if time remains. 4 steps did not finish in 114 s on the H200.
  stage grpo_1_7b 300 "${GRPO[@]}" --models qwen3_1_7b --parts ceilings reference recipe decode --decode-compile on \
    --recipe-steps 2 --decode-batch 256 --repeats 2 --json "$OUT_DIR/grpo_1_7b.json" --time-budget 60
fi

# 7. the report (its exit status is the check's)
echo "=== report: $OUT_DIR/gpu_check.md ($(( SECONDS - START )) s in all)"
"$PYTHON" scripts/gpu_report.py report "$OUT_DIR"
