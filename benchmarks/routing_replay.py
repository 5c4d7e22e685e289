"""Routing replay on and off: a tiny gpt-oss policy sampled by a bf16 transformers engine, trained in fp32.

Every run is the recipe in this process (``tests.recipe_utils.run_in_process``) on a random tiny gpt-oss
directory (``tests.hf_families.make_family_dir``, router gain 1: an unscaled random router, whose near-ties bf16
rounding flips), with ``TransformersGenerator(dtype=bfloat16)`` (it reports its own sampling logprobs, so
``generation/logprob_mismatch`` measures the sampler/trainer gap) and ``moe.routing_replay`` off or ``rollout``,
for each seed. It writes one plot (router agreement, logprob mismatch, reward: every seed thin, the mean thick)
and a JSON of the per-arm means::

    python benchmarks/routing_replay.py --out /tmp/replay --steps 10 --seeds 0 1 2 \\
        --plot docs/images/routing_replay.png --json docs/benchmarks/routing_replay.json
"""

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "recipes")]

ARMS = {"replay off": "off", "replay on (rollout)": "rollout"}
PANELS = [("moe/router_agreement", "router agreement (trainer top-k = engine's)"),
          ("generation/logprob_mismatch", "mean |log pi_trainer - log mu_engine|"),
          ("reward/mean", "reward")]


def run_arm(out: Path, src: Path, replay: str, seed: int, steps: int) -> Path:
    """One recipe run; returns its output directory."""
    from tests.hf_models import hf_components
    from tests.recipe_utils import run_in_process, write_config

    run_dir = out / f"{replay}_seed{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    engine = {"_component_": "torchtune_grpo.generation.TransformersGenerator", "model": str(src), "dtype": "bfloat16"}
    config = write_config(run_dir, **hf_components(src), generation=engine, lr_scheduler=None, seed=seed,
                          max_steps=steps, save_every_n_steps=None, moe={"routing_replay": replay},
                          **{"optimizer.lr": 1e-3})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    run_in_process(config)
    return run_dir / "out"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/torchtune_grpo/routing_replay"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--plot", type=Path, default=None, help="the PNG (default: OUT/routing_replay.png)")
    parser.add_argument("--json", type=Path, default=None, help="also write the per-arm means here")
    args = parser.parse_args()

    from tests.hf_families import make_family_dir
    from torchtune_grpo.metrics.plotting import plot_compare, read_metrics

    args.out.mkdir(parents=True, exist_ok=True)
    src = make_family_dir("gpt_oss", args.out / "model", router_gain=1.0)
    runs = {label: [run_arm(args.out, src, replay, s, args.steps) for s in args.seeds] for label, replay in ARMS.items()}
    plot = plot_compare(runs, PANELS, args.plot or args.out / "routing_replay.png",
                        title="tiny gpt-oss, bf16 transformers engine, fp32 trainer")
    summary = {}
    for label, dirs in runs.items():
        rows = [[r for r in read_metrics(d / "metrics.jsonl") if "loss" in r] for d in dirs]
        summary[label] = {key: sum(r[key] for run in rows for r in run) / sum(len(run) for run in rows)
                          for key, _ in PANELS}
    result = {"steps": args.steps, "seeds": args.seeds, "means_over_steps_and_seeds": summary, "plot": str(plot)}
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
