#!/usr/bin/env bash
# The routing-replay demo: a tiny mixture-of-experts policy (gpt-oss layout) sampled by a bf16 transformers
# engine and trained in fp32, moe.routing_replay off vs rollout, three seeds each; CPU, no downloads.
#
#   bash scripts/demo_routing_replay.sh
#
# One plot, both arms side by side (every seed thin, the mean thick): router agreement (the trainer's own
# top-k vs the engine's), the sampler/trainer logprob mismatch and the reward: $DEMO_DIR/routing_replay.png;
# the last lines give each arm's means over steps and seeds. Environment knobs: DEMO_DIR
# (/tmp/torchtune_grpo/routing_replay), DEMO_SEEDS ("0 1 2"), DEMO_STEPS (10).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$REPO/scripts/_python_env.sh"
WORK="${DEMO_DIR:-/tmp/torchtune_grpo/routing_replay}"
SEEDS="${DEMO_SEEDS:-0 1 2}"
STEPS="${DEMO_STEPS:-10}"
# shellcheck disable=SC2086 # SEEDS is a list
OMP_NUM_THREADS=1 python "$REPO/benchmarks/routing_replay.py" --out "$WORK" --steps "$STEPS" --seeds $SEEDS
