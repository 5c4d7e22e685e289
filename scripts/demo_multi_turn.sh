#!/usr/bin/env bash
# The multi-turn demo: GRPO teaches a tiny model to call a calculator, on CPU, no downloads.
#
#   bash scripts/demo_multi_turn.sh        (or: make demo-multi-turn)
#
#   1. The warm start: the tiny Qwen2-shaped model after SFT on traces of a careless teacher on two-digit
#      products ("What is 56 * 65?"): for ~30% of the problems it calls the calculator (<tool_call> JSON),
#      reads the result and answers "The answer is 3640."; for the others it answers a wrong guess at once.
#      The loss covers the model's turns only (the tool's reply is context). By default the shipped
#      `tiny_qwen2_tools` (seconds: this very SFT, seed 0, made by
#      `DEMO_WARM_START=sft DEMO_SEED=0 DEMO_GRPO_STEPS=0 bash scripts/demo_multi_turn.sh`); with
#      DEMO_WARM_START=sft the script writes the traces and runs the SFT itself with torchtune's own recipe
#      (full_finetune_single_device, ~3.5 min on one core) from the random init. Whether that SFT learns to
#      copy operands and results within its 400 steps depends on the seed (docs/multi_turn.md, "Measured").
#   2. GRPO (our recipe, multi-turn: the calculator as the environment, at most a call and an answer per
#      episode) from the warm start, rewarded by the answer's correctness only, with held-out evaluation
#      (greedy) at step 0 and at the end: accuracy and tool-use rate (metrics.jsonl: eval/*). ~1.5 min.
#
# The last line is `held-out accuracy: <warm start> -> <GRPO>, tool use: <warm start> -> <GRPO>` (greedy,
# fractions of the held-out problems). Environment knobs (the learning test uses them):
#   DEMO_DIR (/tmp/torchtune_grpo/demo_multi_turn), DEMO_SEED (0), DEMO_WARM_START (shipped | sft),
#   DEMO_GRPO_STEPS (10; 0 stops after the warm start); for DEMO_WARM_START=sft: DEMO_PROBLEMS (3200 traces),
#   DEMO_TOOL_RATE (0.3), DEMO_SFT_EPOCHS (4). DEMO_SFT_ARGS and DEMO_GRPO_ARGS add key=value overrides to the
#   two `tune run` commands (e.g. DEMO_GRPO_ARGS="optimizer.lr=5e-4"); defaults are in the YAML files
#   (configs/tiny/demo_multi_turn_*.yaml).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# python, tune and tune-grpo from the active environment, else from .venv (or stop, saying how to set it up)
. "$REPO/scripts/_python_env.sh"
WORK="${DEMO_DIR:-/tmp/torchtune_grpo/demo_multi_turn}"
SEED="${DEMO_SEED:-0}"
WARM_START="${DEMO_WARM_START:-shipped}"
PROBLEMS="${DEMO_PROBLEMS:-3200}"
TOOL_RATE="${DEMO_TOOL_RATE:-0.3}"
SFT_EPOCHS="${DEMO_SFT_EPOCHS:-4}"
GRPO_STEPS="${DEMO_GRPO_STEPS:-10}"
. "$REPO/scripts/_demo_steps.sh"  # threads, step(), a fresh $WORK, sft_stage and warm_start

# The SFT warm start from the random init (DEMO_WARM_START=sft): sets WARM_DIR and WARM_FILE.
sft_warm_start() {
  step "data: a careless teacher's tool-use traces on the train split -> $WORK/traces.jsonl"
  python - "$WORK/traces.jsonl" "$PROBLEMS" "$TOOL_RATE" "$SEED" <<'PY'
import json, sys
from torchtune_grpo.data import careless_calculator_traces

out, n, rate, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
# The problem space of configs/tiny/demo_multi_turn_grpo.yaml's dataset (train split; none held out).
rows, counts = careless_calculator_traces(n, min_value=32, max_value=99, operations=["*"], tool_rate=rate, seed=seed)
with open(out, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
print(f"{counts['problems']} problems: the teacher called the calculator for {counts['tool_calls']} and "
      f"guessed (wrong) for {counts['guesses']}")
PY
  sft_stage "1/2" "$REPO/configs/tiny/demo_multi_turn_sft.yaml" "$WORK/traces.jsonl"
}

warm_start "1/2" tiny_qwen2_tools

step "2/2 GRPO with the calculator: tune run grpo_full_finetune_distributed, $GRPO_STEPS steps"
tune run grpo_full_finetune_distributed --config "$REPO/configs/tiny/demo_multi_turn_grpo.yaml" \
  checkpointer.checkpoint_dir="$WARM_DIR" "checkpointer.checkpoint_files=[$WARM_FILE]" output_dir="$WORK/grpo" \
  max_steps="$GRPO_STEPS" dataset.num_samples="$PROBLEMS" dataset.seed="$SEED" seed="$SEED" ${DEMO_GRPO_ARGS:-} > "$WORK/grpo.log" 2>&1 \
  || { tail -n 40 "$WORK/grpo.log"; exit 1; }
grep -a "Held-out evaluation at" "$WORK/grpo.log" | sed 's/.*Held-out/Held-out/' || true
echo "GRPO checkpoint: $WORK/grpo/step_$GRPO_STEPS (log: $WORK/grpo.log, metrics: $WORK/grpo/metrics.jsonl," \
  "episodes: $WORK/grpo/completions.jsonl)"

echo
echo "demo finished in $(elapsed) (outputs in $WORK)"
python - "$WORK/grpo/metrics.jsonl" <<'PY'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if "eval/accuracy" in r]
before, after = evals[0], evals[-1]
print(f"held-out accuracy: {before['eval/accuracy']:.2f} -> {after['eval/accuracy']:.2f}, "
      f"tool use: {before['eval/tool_use_rate']:.2f} -> {after['eval/tool_use_rate']:.2f}")
PY
