#!/usr/bin/env bash
# The image demo: GRPO with pictures in the prompt, on a tiny vision-language model, on CPU, no downloads.
#
#   bash scripts/demo_images.sh        (or: make demo-images)
#
#   1. Data: pictures of 1 to 4 shapes drawn here with PIL, "How many shapes are in the picture?", as JSONL files
#      of image paths (torchtune_grpo.data.write_shape_count_data): a train split for GRPO, a held-out split.
#   2. The SFT warm start: a tiny random Gemma 3 image-text model (SigLIP tower, 4 image tokens per picture) after
#      supervised fine-tuning on the counts of a careless teacher, who overlooks one shape in 65% of the pictures
#      with 3 or 4 shapes. By default the shipped `tiny_gemma3_shapes` (this very SFT, seed 0, made by
#      `DEMO_WARM_START=sft DEMO_SEED=0 DEMO_GRPO_STEPS=0 bash scripts/demo_images.sh`); with DEMO_WARM_START=sft
#      the script builds the random model (torchtune_grpo.data.tiny_gemma3_dir), draws the SFT pictures and
#      trains it (torchtune_grpo.data.image_sft, a plain PyTorch loop: torchtune's SFT recipe does not train
#      image-text models; about 1 minute).
#   3. GRPO (our recipe, image_dataset prompts, the native engine prefilling with the pixels, the tower frozen),
#      rewarded by exact match of the count, evaluated on the held-out pictures at step 0, every
#      eval_every_n_steps and at the end (greedy accuracy, pass@4; metrics.jsonl: eval/*).
#   4. The plot (tune-grpo plot): reward, held-out accuracy, KL and response length against step.
#
# The last line is `held-out accuracy: <warm start> -> <GRPO>` (greedy, fractions of the held-out pictures, from
# the recipe's evaluation at step 0 and at the last step). Environment knobs (the tests use them):
#   DEMO_DIR (/tmp/torchtune_grpo/demo_images), DEMO_SEED (0), DEMO_WARM_START (shipped | sft), DEMO_GRPO_STEPS
#   (20; 0 stops after the warm start), DEMO_EVAL_EVERY (5), DEMO_PICTURES (512 train pictures for GRPO),
#   DEMO_HELD_OUT (200); for DEMO_WARM_START=sft: DEMO_SFT_PICTURES (8000), DEMO_SFT_EPOCHS (2), DEMO_MISS_RATE
#   (0.65). DEMO_GRPO_ARGS adds key=value overrides to the `tune run` command (e.g. "optimizer.lr=1e-4"); the
#   rest is in configs/tiny/demo_images_grpo.yaml.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# python, tune and tune-grpo from the active environment, else from .venv (or stop, saying how to set it up)
. "$REPO/scripts/_python_env.sh"
python -c "import transformers" 2>/dev/null || {
  echo "the image demo needs transformers (its tiny Gemma 3 is transformers' own model): pip install" \
    "transformers==5.19.0, or run \`make demo-images\`, which adds it to .venv" >&2; exit 1; }
WORK="${DEMO_DIR:-/tmp/torchtune_grpo/demo_images}"
SEED="${DEMO_SEED:-0}"
WARM_START="${DEMO_WARM_START:-shipped}"
PICTURES="${DEMO_PICTURES:-512}"
HELD_OUT="${DEMO_HELD_OUT:-200}"
SFT_PICTURES="${DEMO_SFT_PICTURES:-8000}"
SFT_EPOCHS="${DEMO_SFT_EPOCHS:-2}"
MISS_RATE="${DEMO_MISS_RATE:-0.65}"
GRPO_STEPS="${DEMO_GRPO_STEPS:-20}"
EVAL_EVERY="${DEMO_EVAL_EVERY:-5}"
. "$REPO/scripts/_demo_steps.sh"  # threads, step(), a fresh $WORK and warm_start

step "1/4 data: pictures of 1 to 4 shapes -> $WORK/train.jsonl ($PICTURES), $WORK/held_out.jsonl ($HELD_OUT)"
python - "$WORK" "$PICTURES" "$HELD_OUT" "$SEED" <<'PY'
import sys
from torchtune_grpo.data import write_shape_count_data

work, n, held_out, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
write_shape_count_data(work, "train", n, seed=seed, split="train")
write_shape_count_data(work, "held_out", held_out, seed=seed, split="validation")  # never trained on
PY
head -n 1 "$WORK/train.jsonl"

# The SFT warm start from the random init (DEMO_WARM_START=sft): sets WARM_DIR and WARM_FILE.
sft_warm_start() {
  step "2/4 SFT warm start: a tiny random Gemma 3 image-text model, $SFT_EPOCHS epoch(s) on $SFT_PICTURES pictures"
  python - "$WORK" "$SFT_PICTURES" "$SFT_EPOCHS" "$MISS_RATE" "$SEED" <<'PY'
import sys
from torchtune_grpo.data import image_sft, tiny_gemma3_dir, write_shape_count_data

work, n, epochs, miss_rate, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
# Pictures of the train split (none held out), with the careless teacher's counts in the `teacher` column.
data = write_shape_count_data(work, "sft_pictures", n, seed=seed + 1000, split="train", miss_rate=miss_rate)
tiny_gemma3_dir(f"{work}/random_init", seed=seed)
image_sft(f"{work}/random_init", data, f"{work}/sft", epochs=epochs, seed=seed)
PY
  WARM_DIR="$WORK/sft"
  WARM_FILE=model.safetensors
  echo "SFT checkpoint: $WARM_DIR"
}

warm_start "2/4" tiny_gemma3_shapes

step "3/4 GRPO on image prompts: tune run grpo_full_finetune_distributed, $GRPO_STEPS steps"
tune run grpo_full_finetune_distributed --config "$REPO/configs/tiny/demo_images_grpo.yaml" \
  checkpointer.checkpoint_dir="$WARM_DIR" output_dir="$WORK/grpo" max_steps="$GRPO_STEPS" \
  dataset.data_files="$WORK/train.jsonl" validation.data_files="$WORK/held_out.jsonl" \
  eval_every_n_steps="$EVAL_EVERY" seed="$SEED" ${DEMO_GRPO_ARGS:-} > "$WORK/grpo.log" 2>&1 \
  || { tail -n 40 "$WORK/grpo.log"; exit 1; }
grep -a "Held-out evaluation at" "$WORK/grpo.log" | sed 's/.*Held-out/Held-out/' || true
echo "GRPO checkpoint: $WORK/grpo/step_$GRPO_STEPS (log: $WORK/grpo.log, metrics: $WORK/grpo/metrics.jsonl)"

step "4/4 plot: tune-grpo plot"
tune-grpo plot "$WORK/grpo" --out "$WORK/training_curves.png" --title "GRPO on the tiny image demo (counting shapes)"

echo
echo "demo finished in $(elapsed) (outputs in $WORK)"
python - "$WORK/grpo/metrics.jsonl" <<'PY'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if "eval/accuracy" in r]
print(f"held-out accuracy: {evals[0]['eval/accuracy']:.2f} -> {evals[-1]['eval/accuracy']:.2f}")
PY
