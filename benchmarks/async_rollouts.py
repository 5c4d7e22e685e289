"""Synchronous vs asynchronous rollouts (generation workers, docs/async.md), side by side in one run.

Modes, each a fresh child process running the real recipe on a grpo_vs_trl workload (same weights, prompts
and settings), one after another:

- ``sync``: today's colocated step, the trainer with ``--threads`` (default 2) threads;
- ``sync_separate``: a generation worker at ``max_staleness: 0`` (on-policy, no overlap), trainer and worker
  one thread each: generation and training on separate cores;
- ``one_step_off``: the same at ``max_staleness: 1``;
- ``stream_2``: ``max_staleness: 2``.

Per mode: steps per second (median step time, the first step excluded), the trainer's busy fraction (its step
minus the time it waited for rollouts, over the step), the generator's (its generation and scoring time per
step over the step), staleness and the sampler/trainer logprob mismatch; and the ratio of each mode's steps
per second to ``sync_separate``'s (the goal: ``one_step_off`` >= 1.4x on the SmolLM2 workload)::

    python benchmarks/async_rollouts.py --workloads tiny llama100m --steps 8 --json /tmp/async.json
    python benchmarks/async_rollouts.py --workloads --smollm2 /tmp/smollm2-135m --steps 6   # SmolLM2 only
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import grpo_vs_trl as bench
from harness import loadavg, recipe_module, run_child, write_report

MODES: Dict[str, Dict[str, Any]] = {
    "sync": {"workers": None},
    "sync_separate": {"workers": 0},
    "one_step_off": {"workers": 1},
    "stream_2": {"workers": 2},
}


def child(workload_dir: Path, out: Path, steps: int, staleness: Optional[int]) -> None:
    """Child: the recipe on the workload; its metrics.jsonl is the result.

    ``workload_dir`` is a grpo_vs_trl workload, or (a ``smollm2.json`` in it) the SmolLM2 task of
    learning_vs_trl.py: its model directory and seed-0 prompt order, its recipe settings.
    """
    from omegaconf import OmegaConf

    smol = workload_dir / "smollm2.json"
    if smol.exists():
        import learning_vs_trl

        model_dir = Path(json.loads(smol.read_text())["model_dir"])
        config = learning_vs_trl.recipe_config(model_dir, workload_dir / "train_order.jsonl", out, 0, steps)
        config["metric_logger"]["log_dir"] = str(out / "logs")
    else:
        spec = json.loads((workload_dir / "workload.json").read_text())
        config = bench.recipe_config(workload_dir, out, spec, steps)
    cfg = OmegaConf.create(config)
    if staleness is not None:
        cfg.generation_workers = {"enabled": True, "max_staleness": staleness, "threads": 1}
    recipe = recipe_module().GRPOFullFinetuneRecipeDistributed(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.optimizer.zero_grad(set_to_none=True)
    while recipe.global_step < recipe.total_steps:
        recipe.train_step()
    recipe.cleanup()


def smollm2_workload(model_dir: Path, workload_dir: Path) -> Path:
    """The SmolLM2 task of learning_vs_trl.py in ``workload_dir``: its train split in seed 0's order."""
    import learning_vs_trl

    workload_dir.mkdir(parents=True, exist_ok=True)
    learning_vs_trl.build_task(model_dir.resolve(), workload_dir / "task")
    learning_vs_trl.write_seed_order(workload_dir / "task", 0, workload_dir)
    (workload_dir / "smollm2.json").write_text(json.dumps({"model_dir": str(model_dir.resolve())}))
    return workload_dir


def summarize(metrics: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Medians over the measured steps (the first excluded: start-up and the first weight transfer)."""
    rows = metrics[1:] if len(metrics) > 1 else metrics
    step = statistics.median(m["time/step"] for m in rows)
    generation = statistics.median(m["time/generation"] + m["time/reward"] for m in rows)
    wait = statistics.median(m.get("time/rollout_wait", m["time/generation"] + m["time/reward"]) for m in rows)
    return {
        "steps_per_second": 1.0 / step,
        "step_time_median_s": step,
        "trainer_busy_fraction": max(0.0, 1.0 - wait / step),
        "generator_busy_fraction": min(1.0, generation / step),
        "staleness_mean": statistics.mean(m.get("staleness/mean", 0.0) for m in rows),
        "logprob_mismatch_mean": statistics.mean(m.get("generation/logprob_mismatch", 0.0) for m in rows),
        "reward_mean": statistics.mean(m["reward/mean"] for m in rows),
    }


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="*", default=["tiny", "llama100m"], choices=list(bench.WORKLOADS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="threads of the synchronous trainer")
    parser.add_argument("--smollm2", default=None, metavar="DIR",
                        help="also the SmolLM2 task of learning_vs_trl.py (4 x 8, <= 48 tokens), this HF directory "
                             "(benchmarks/smollm2.py makes it)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report: Dict[str, Any] = {"loadavg_before": loadavg(), "steps": args.steps, "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="async_bench_") as tmp:
        for name in args.workloads + (["smollm2"] if args.smollm2 else []):
            wdir = smollm2_workload(Path(args.smollm2), Path(tmp) / name) if name == "smollm2" else \
                bench.build_workload(name, Path(tmp) / name)
            entry: Dict[str, Any] = {}
            for mode in args.modes:
                staleness = MODES[mode]["workers"]
                out = Path(tmp) / "runs" / name / mode
                threads = args.threads if staleness is None else 1
                run_child(sys.executable, Path(__file__).resolve(),
                          ["_child", str(wdir), str(out), str(args.steps), json.dumps(staleness)], threads=threads)
                metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
                entry[mode] = summarize([m for m in metrics if "loss" in m])
                print(f"[{name}] {mode}: {entry[mode]['steps_per_second']:.3f} steps/s (load {loadavg()})", flush=True)
            if "sync_separate" in entry:
                for mode in entry:
                    entry[mode]["speedup_vs_sync_separate"] = (
                        entry[mode]["steps_per_second"] / entry["sync_separate"]["steps_per_second"]
                    )
            report["workloads"][name] = entry
    report["loadavg_after"] = loadavg()
    write_report(report, Path(args.json) if args.json else None, markdown_table(report))


def markdown_table(report: Dict[str, Any]) -> str:
    lines = ["| workload | mode | steps/s | vs sync_separate | trainer busy | generator busy | staleness | mismatch |",
             "|---|---|---|---|---|---|---|---|"]
    for name, entry in report["workloads"].items():
        for mode, r in entry.items():
            lines.append(
                f"| {name} | {mode} | {r['steps_per_second']:.3f} | {r.get('speedup_vs_sync_separate', 1.0):.2f}x "
                f"| {r['trainer_busy_fraction']:.2f} | {r['generator_busy_fraction']:.2f} | {r['staleness_mean']:.2f} "
                f"| {r['logprob_mismatch_mean']:.2e} |"
            )
    lines.append(f"\nload average before: {report['loadavg_before']}, after: {report['loadavg_after']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5]))
    else:
        main()
