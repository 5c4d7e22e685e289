#!/usr/bin/env bash
# The embedded demo: the DeepSeek-R1 order on a tiny model and a verifiable task, on CPU, no downloads.
#
#   bash scripts/demo.sh
#
#   1. SFT warm start: torchtune's own recipe (full_finetune_single_device) on the tiny Qwen2-shaped model
#      from its random init, with our sft_dataset builder over synthetic arithmetic TRAIN problems
#      ("What is 13 + 6?" -> " 13 + 6 = 19 </think> <answer> 19 </answer>").
#   2. GRPO (our recipe) from the SFT checkpoint, rewarded by exact match of the <answer>, evaluated on the
#      held-out split at step 0, every eval_every_n_steps and at the end (metrics.jsonl: eval/*).
#   3. Held-out evaluation of both checkpoints (tune-grpo eval: greedy accuracy, mean reward, pass@k).
#   4. The plot (tune-grpo plot): reward, held-out accuracy, KL and response length against step.
#
# The last line is `held-out accuracy: <SFT> -> <GRPO>` (greedy, fractions of the held-out problems).
# Environment knobs (the learning test uses them to run a shorter demo):
#   DEMO_DIR (/tmp/torchtune_grpo/demo), DEMO_SEED (0), DEMO_SFT_EPOCHS, DEMO_GRPO_STEPS,
#   DEMO_EVAL_EVERY; anything else goes through the YAML files (configs/tiny/demo_*.yaml).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${DEMO_DIR:-/tmp/torchtune_grpo/demo}"
SEED="${DEMO_SEED:-0}"
SFT_EPOCHS="${DEMO_SFT_EPOCHS:-30}"
GRPO_STEPS="${DEMO_GRPO_STEPS:-40}"
EVAL_EVERY="${DEMO_EVAL_EVERY:-5}"
# One thread per process: on 2 shared cores, 2 OpenMP threads per process were much slower (barriers
# stall when another process holds a core), and results do not depend on the core count.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1

START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }
step() { echo; echo "==== [$(elapsed)] $*"; }

rm -rf "$WORK"
mkdir -p "$WORK"
cd "$WORK"  # `tune run` finds the recipes as installed modules, from any directory

step "data: synthetic arithmetic train problems -> $WORK/arith_train.jsonl"
python - "$WORK/arith_train.jsonl" "$SEED" <<'EOF'
import json, sys
from omegaconf import OmegaConf
from torchtune_grpo.data import arithmetic_problems

out, seed = sys.argv[1], int(sys.argv[2])
# The same problem space as the GRPO config's dataset (every train problem, none of the held-out ones).
ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
problems = arithmetic_problems(608, max_value=20, seed=seed, split="train")
with open(out, "w") as f:
    for a, op, b in problems:
        c = ops[op](a, b)
        f.write(json.dumps({"question": f"What is {a} {op} {b}?", "answer": str(c),
                            "reasoning": f"{a} {op} {b} = {c}"}) + "\n")
print(f"{len(problems)} problems")
EOF

ASSET_DIR="$(python -c 'from torchtune_grpo.assets import asset_path; print(asset_path("tiny_qwen2"))')"

step "1/4 SFT warm start: tune run full_finetune_single_device (torchtune's recipe), $SFT_EPOCHS epochs"
tune run full_finetune_single_device --config "$REPO/configs/tiny/demo_sft.yaml" \
  asset_dir="$ASSET_DIR" dataset.data_files="$WORK/arith_train.jsonl" dataset.cache_dir="$WORK/hf_cache" \
  output_dir="$WORK/sft" epochs="$SFT_EPOCHS" seed="$SEED" > "$WORK/sft.log" 2>&1 \
  || { tail -n 40 "$WORK/sft.log"; exit 1; }
SFT_CKPT="$WORK/sft/epoch_$((SFT_EPOCHS - 1))"
echo "SFT checkpoint: $SFT_CKPT (log: $WORK/sft.log)"

step "2/4 GRPO: tune run grpo_full_finetune_distributed, $GRPO_STEPS steps"
tune run grpo_full_finetune_distributed --config "$REPO/configs/tiny/demo_grpo.yaml" \
  checkpointer.checkpoint_dir="$SFT_CKPT" output_dir="$WORK/grpo" max_steps="$GRPO_STEPS" \
  eval_every_n_steps="$EVAL_EVERY" seed="$SEED" > "$WORK/grpo.log" 2>&1 \
  || { tail -n 40 "$WORK/grpo.log"; exit 1; }
GRPO_CKPT="$WORK/grpo/step_$GRPO_STEPS"
grep -a "Held-out evaluation at" "$WORK/grpo.log" | sed 's/.*Held-out/Held-out/' || true
echo "GRPO checkpoint: $GRPO_CKPT (log: $WORK/grpo.log, metrics: $WORK/grpo/metrics.jsonl)"

step "3/4 held-out evaluation: tune-grpo eval (SFT checkpoint, then GRPO checkpoint)"
tune-grpo eval --config "$REPO/configs/tiny/demo_grpo.yaml" checkpoint_dir="$SFT_CKPT" \
  seed="$SEED" json="$WORK/eval_sft.json"
tune-grpo eval --config "$REPO/configs/tiny/demo_grpo.yaml" checkpoint_dir="$GRPO_CKPT" \
  seed="$SEED" json="$WORK/eval_grpo.json"

step "4/4 plot: tune-grpo plot"
tune-grpo plot "$WORK/grpo" --out "$WORK/training_curves.png" --title "GRPO on the tiny arithmetic demo"

echo
echo "demo finished in $(elapsed) (outputs in $WORK)"
python - "$WORK/eval_sft.json" "$WORK/eval_grpo.json" <<'EOF'
import json, sys
before, after = (json.load(open(p))["accuracy"] for p in sys.argv[1:3])
print(f"held-out accuracy: {before:.2f} -> {after:.2f}")
EOF
