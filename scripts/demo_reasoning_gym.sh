#!/usr/bin/env bash
# GRPO on a reasoning-gym task on CPU: does held-out accuracy rise within minutes? (docs/environments.md,
# "Worked example"). Needs the reasoning-gym extra on the path (pip install ".[reasoning-gym]", or the folder
# scripts/setup_env.sh makes: PYTHONPATH=.venv/extras/reasoning-gym).
#
#   bash scripts/demo_reasoning_gym.sh        # DEMO_SEED (0), DEMO_STEPS (20), DEMO_OUT, DEMO_ARGS (overrides)
#
# Runs configs/tiny/demo_reasoning_gym_grpo.yaml (the shipped tiny_qwen2_arith on chain_sum; greedy held-out
# evaluation at step 0, every 5 steps and at the end) and prints, last,
# `held-out accuracy: <step 0> -> <end> (pass@4: <step 0> -> <end>), <seconds> s`.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SEED="${DEMO_SEED:-0}"
STEPS="${DEMO_STEPS:-20}"
OUT="${DEMO_OUT:-/tmp/torchtune_grpo/demo_reasoning_gym_seed$SEED}"
rm -rf "$OUT"
start=$(date +%s)
# shellcheck disable=SC2086 # DEMO_ARGS is a list of overrides
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" tune run grpo_full_finetune_distributed \
  --config "$REPO/configs/tiny/demo_reasoning_gym_grpo.yaml" output_dir="$OUT" seed="$SEED" max_steps="$STEPS" \
  ${DEMO_ARGS:-} > "$OUT.log" 2>&1 || { tail -40 "$OUT.log"; exit 1; }
python - "$OUT/metrics.jsonl" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in rows if "eval/accuracy" in r]
first, last = evals[0], evals[-1]
for r in evals:
    print(f"step {r['step']:>3}: held-out accuracy {r['eval/accuracy']:.2f}, pass@4 {r.get('eval/pass@4', float('nan')):.2f}")
print(f"held-out accuracy: {first['eval/accuracy']:.2f} -> {last['eval/accuracy']:.2f} "
      f"(pass@4: {first.get('eval/pass@4', float('nan')):.2f} -> {last.get('eval/pass@4', float('nan')):.2f}), {sys.argv[2]} s")
PY
