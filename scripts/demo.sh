#!/usr/bin/env bash
# The embedded demo: the DeepSeek-R1 order on a tiny model and a verifiable task, on CPU, no downloads.
#
#   bash scripts/demo.sh        (or: make demo)
#
#   1. The SFT warm start: the tiny Qwen2-shaped model after torchtune's own recipe (full_finetune_single_device)
#      on worked two-digit additions of the TRAIN split ("What is 58 + 67?" ->
#      " 8+7=15,5+6+1=12 </think> <answer> 125 </answer>") from a careless teacher who drops the carry ("+0")
#      in 65% of the problems that need one. By default the shipped `tiny_qwen2_addition` (this very SFT,
#      seed 0, made by `DEMO_WARM_START=sft DEMO_SEED=0 DEMO_GRPO_STEPS=0 bash scripts/demo.sh`); with
#      DEMO_WARM_START=sft the script writes the data and runs the SFT itself from the random init (4 epochs
#      of 7,000 problems: about 2 minutes on one core of a 2-core AVX-512 Xeon).
#   2. GRPO (our recipe) from the warm start, rewarded by exact match of the <answer>, evaluated on the
#      held-out split at step 0, every eval_every_n_steps and at the end (metrics.jsonl: eval/*).
#   3. Held-out evaluation of both checkpoints (tune-grpo eval: greedy accuracy, mean reward, pass@k), the
#      two side by side (one process each).
#   4. The plot (tune-grpo plot): reward, held-out accuracy, KL and response length against step.
#
# The last line is `held-out accuracy: <SFT> -> <GRPO>` (greedy, fractions of the held-out problems).
# Environment knobs (the learning tests use them):
#   DEMO_DIR (/tmp/torchtune_grpo/demo), DEMO_SEED (0), DEMO_WARM_START (shipped | sft), DEMO_GRPO_STEPS (20;
#   0 stops after the warm start), DEMO_EVAL_EVERY (5); for DEMO_WARM_START=sft: DEMO_SFT_EPOCHS (4),
#   DEMO_SFT_PROBLEMS (7000), DEMO_CARRY_DROP (0.65). DEMO_SFT_ARGS and DEMO_GRPO_ARGS add key=value
#   overrides to the two `tune run` commands (e.g. DEMO_SFT_ARGS="max_steps_per_epoch=2"); the rest is in
#   the YAML files (configs/tiny/demo_*.yaml).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# python, tune and tune-grpo from the active environment, else from .venv (or stop, saying how to set it up)
. "$REPO/scripts/_python_env.sh"
WORK="${DEMO_DIR:-/tmp/torchtune_grpo/demo}"
SEED="${DEMO_SEED:-0}"
WARM_START="${DEMO_WARM_START:-shipped}"
SFT_EPOCHS="${DEMO_SFT_EPOCHS:-4}"
SFT_PROBLEMS="${DEMO_SFT_PROBLEMS:-7000}"
CARRY_DROP="${DEMO_CARRY_DROP:-0.65}"
GRPO_STEPS="${DEMO_GRPO_STEPS:-20}"
EVAL_EVERY="${DEMO_EVAL_EVERY:-5}"
. "$REPO/scripts/_demo_steps.sh"  # threads, step(), a fresh $WORK, sft_stage and warm_start

# The SFT warm start from the random init (DEMO_WARM_START=sft): sets WARM_DIR and WARM_FILE.
sft_warm_start() {
  step "data: worked additions of the train split from a careless teacher -> $WORK/addition_train.jsonl"
  python - "$WORK/addition_train.jsonl" "$SFT_PROBLEMS" "$CARRY_DROP" "$SEED" <<'PY'
import json, sys
from torchtune_grpo.data import addition_sft_rows

out, n, drop, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
# The same problems as configs/tiny/demo_grpo.yaml's dataset (train split; none of the held-out ones).
rows, counts = addition_sft_rows(n, min_value=10, max_value=99, carry_drop_rate=drop, seed=seed)
with open(out, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
print(f"{counts['problems']} problems, {counts['need_carry']} need a carry, the teacher dropped it in "
      f"{counts['carry_dropped']} (their answers are wrong)")
PY
  sft_stage "1/4" "$REPO/configs/tiny/demo_sft.yaml" "$WORK/addition_train.jsonl"
}

warm_start "1/4" tiny_qwen2_addition

step "2/4 GRPO: tune run grpo_full_finetune_distributed, $GRPO_STEPS steps"
tune run grpo_full_finetune_distributed --config "$REPO/configs/tiny/demo_grpo.yaml" \
  checkpointer.checkpoint_dir="$WARM_DIR" "checkpointer.checkpoint_files=[$WARM_FILE]" output_dir="$WORK/grpo" \
  max_steps="$GRPO_STEPS" dataset.num_samples="$SFT_PROBLEMS" dataset.seed="$SEED" \
  eval_every_n_steps="$EVAL_EVERY" seed="$SEED" ${DEMO_GRPO_ARGS:-} > "$WORK/grpo.log" 2>&1 \
  || { tail -n 40 "$WORK/grpo.log"; exit 1; }
GRPO_CKPT="$WORK/grpo/step_$GRPO_STEPS"
grep -a "Held-out evaluation at" "$WORK/grpo.log" | sed 's/.*Held-out/Held-out/' || true
echo "GRPO checkpoint: $GRPO_CKPT (log: $WORK/grpo.log, metrics: $WORK/grpo/metrics.jsonl)"

step "3/4 held-out evaluation: tune-grpo eval of the warm start and of the GRPO checkpoint, side by side"
# Two processes at once (one thread each): most of each one's time is start-up (imports, the model build).
tune-grpo eval --config "$REPO/configs/tiny/demo_grpo.yaml" checkpoint_dir="$WARM_DIR" \
  seed="$SEED" json="$WORK/eval_sft.json" > "$WORK/eval_sft.out" 2> "$WORK/eval_sft.log" &
EVAL_SFT=$!
tune-grpo eval --config "$REPO/configs/tiny/demo_grpo.yaml" checkpoint_dir="$GRPO_CKPT" \
  seed="$SEED" json="$WORK/eval_grpo.json" > "$WORK/eval_grpo.out" 2> "$WORK/eval_grpo.log" &
EVAL_GRPO=$!
for run in "sft $EVAL_SFT" "grpo $EVAL_GRPO"; do
  name="${run% *}"
  wait "${run#* }" || { cat "$WORK/eval_$name.out"; tail -n 40 "$WORK/eval_$name.log"
                        kill "$EVAL_SFT" "$EVAL_GRPO" 2>/dev/null; exit 1; }
  cat "$WORK/eval_$name.out"  # its results (the progress bar went to eval_$name.log)
done

step "4/4 plot: tune-grpo plot"
tune-grpo plot "$WORK/grpo" --out "$WORK/training_curves.png" --title "GRPO on the tiny arithmetic demo"

echo
echo "demo finished in $(elapsed) (outputs in $WORK)"
python - "$WORK/eval_sft.json" "$WORK/eval_grpo.json" <<'PY'
import json, sys
before, after = (json.load(open(p))["accuracy"] for p in sys.argv[1:3])
print(f"held-out accuracy: {before:.2f} -> {after:.2f}")
PY
