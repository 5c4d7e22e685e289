#!/usr/bin/env bash
# The process-rewards demo: outcome vs process-supervised advantages on worked additions, CPU, no downloads.
#
#   bash scripts/demo_process_rewards.sh        (or: make demo-process-rewards)
#
#   1. SFT warm start (torchtune's full_finetune_single_device, configs/tiny/demo_sft.yaml) on worked two-digit
#      additions from a teacher who drops the carry in DEMO_CARRY_DROP of the problems that need one and, in
#      DEMO_LUCKY of those, still writes the true sum: a lucky answer, right for a wrong derivation
#      ("8+7=15,5+6+0=11 </think> <answer> 125 </answer>").
#   2. GRPO from it, DEMO_GRPO_STEPS steps, seeds DEMO_SEEDS, in two arms that differ only in `advantage`:
#      outcome (GroupRelativeAdvantage on correctness + 0.1 format) and process (ProcessSupervisedAdvantage,
#      the same outcome plus the group-normalised step scores of torchtune_grpo.rewards.column_addition_step,
#      DeepSeekMath section 4.1.3). Both runs log the step checker (weight 0): reward/column_steps/mean is
#      the share of sampled derivations right in every column.
#   3. One plot, both arms side by side (every seed thin, the mean thick): $DEMO_DIR/process_vs_outcome.png.
#
# The last lines give, per arm, the mean over seeds of the last 5 steps' correctness and sound-derivation
# share. Environment knobs: DEMO_DIR (/tmp/torchtune_grpo/demo_process), DEMO_SEEDS ("0 1 2"),
# DEMO_SFT_EPOCHS (4), DEMO_SFT_PROBLEMS (7000), DEMO_CARRY_DROP (0.65), DEMO_LUCKY (0.5), DEMO_GRPO_STEPS (20),
# DEMO_GRPO_ARGS (key=value overrides of both GRPO runs).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$REPO/scripts/_python_env.sh"
WORK="${DEMO_DIR:-/tmp/torchtune_grpo/demo_process}"
SEEDS="${DEMO_SEEDS:-0 1 2}"
SFT_EPOCHS="${DEMO_SFT_EPOCHS:-4}"
SFT_PROBLEMS="${DEMO_SFT_PROBLEMS:-7000}"
CARRY_DROP="${DEMO_CARRY_DROP:-0.65}"
LUCKY="${DEMO_LUCKY:-0.5}"
GRPO_STEPS="${DEMO_GRPO_STEPS:-20}"
read -r -a GRPO_ARGS <<< "${DEMO_GRPO_ARGS:-}"
SEED=0  # the SFT stage's seed; the GRPO runs take theirs from DEMO_SEEDS
# The demos' shared steps: threads and offline settings, step(), a fresh $WORK, sft_stage.
. "$REPO/scripts/_demo_steps.sh"

step "data: worked additions from a careless, sometimes lucky teacher -> $WORK/addition_train.jsonl"
python - "$WORK/addition_train.jsonl" "$SFT_PROBLEMS" "$CARRY_DROP" "$LUCKY" <<'EOF_PY'
import json, random, sys
from torchtune_grpo.data import addition_sft_rows, addition_worked_solution

out, n, drop, lucky = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rows, counts = addition_sft_rows(n, min_value=10, max_value=99, carry_drop_rate=drop, seed=0)
rng = random.Random("lucky-teacher")
lucky_rows = 0
for row in rows:
    a, b = (int(x) for x in row["question"][len("What is "):-1].split(" + "))
    true_answer = addition_worked_solution(a, b)[1]
    if row["answer"] != true_answer and rng.random() < lucky:
        row["answer"] = true_answer  # the dropped carry stays in the reasoning; the answer is right anyway
        lucky_rows += 1
with open(out, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
print(f"{counts['problems']} problems, {counts['need_carry']} need a carry, the teacher dropped it in "
      f"{counts['carry_dropped']}: {counts['carry_dropped'] - lucky_rows} wrong answers, {lucky_rows} lucky ones")
EOF_PY

sft_stage "1/3" "$REPO/configs/tiny/demo_sft.yaml" "$WORK/addition_train.jsonl"  # sets WARM_DIR

# The outcome arm: the same file with GroupRelativeAdvantage (the step checker stays, at weight 0, for its metric).
python - "$REPO/configs/tiny/demo_process_grpo.yaml" "$WORK/outcome.yaml" <<'EOF_PY'
import sys
from omegaconf import OmegaConf

cfg = OmegaConf.load(sys.argv[1])
cfg.advantage = {"_component_": "torchtune_grpo.rollouts.advantages.GroupRelativeAdvantage", "scale_by_std": True}
OmegaConf.save(cfg, sys.argv[2])
EOF_PY

for SEED in $SEEDS; do
  for ARM in outcome process; do
    CONFIG="$REPO/configs/tiny/demo_process_grpo.yaml"
    [ "$ARM" = outcome ] && CONFIG="$WORK/outcome.yaml"
    step "2/3 GRPO, $ARM advantages, seed $SEED: $GRPO_STEPS steps"
    tune run grpo_full_finetune_distributed --config "$CONFIG" \
      checkpointer.checkpoint_dir="$WARM_DIR" output_dir="$WORK/${ARM}_$SEED" max_steps="$GRPO_STEPS" \
      dataset.num_samples="$SFT_PROBLEMS" seed="$SEED" eval_every_n_steps=null validation=null \
      save_every_n_steps=null "${GRPO_ARGS[@]}" > "$WORK/${ARM}_$SEED.log" 2>&1 \
      || { tail -n 40 "$WORK/${ARM}_$SEED.log"; exit 1; }
  done
done

step "3/3 plot: $WORK/process_vs_outcome.png"
python - "$WORK" "$SEEDS" <<'EOF_PY'
import sys
from pathlib import Path
from torchtune_grpo.metrics.plotting import plot_compare, read_metrics

work, seeds = Path(sys.argv[1]), sys.argv[2].split()
arms = {"outcome advantage": [work / f"outcome_{s}" for s in seeds],
        "outcome + process advantage": [work / f"process_{s}" for s in seeds]}
plot_compare(arms, [("reward/correctness/mean", "answer correct (sampled)"),
                    ("reward/column_steps/mean", "every step right (sampled)")],
             work / "process_vs_outcome.png", title="Outcome vs process-supervised advantages, worked additions")
for label, dirs in arms.items():
    last = [r for d in dirs for r in read_metrics(d / "metrics.jsonl")[-5:]]
    first = [read_metrics(d / "metrics.jsonl")[0] for d in dirs]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)
    print(f"{label}: answer correct {mean(first, 'reward/correctness/mean'):.2f} -> "
          f"{mean(last, 'reward/correctness/mean'):.2f}, every step right {mean(first, 'reward/column_steps/mean'):.2f} "
          f"-> {mean(last, 'reward/column_steps/mean'):.2f} (step 1 -> mean of the last 5 steps, {len(dirs)} seeds)")
EOF_PY
echo "demo finished in $(elapsed) (outputs in $WORK)"
