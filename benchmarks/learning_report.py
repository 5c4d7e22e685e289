"""Pure aggregation, tables and plot of ``benchmarks/learning_vs_trl.py`` runs (no model, no TRL).

A run is one trainer ("ours" or "trl") on one seed::

    {"side": "ours", "seed": 0,
     "steps": [{"step": 1, "reward": 0.41, "entropy": 0.93, "response_length": 21.5, "grad_norm": 0.8,
                "seconds": 9.8, "elapsed": 9.8}, ...],
     "evals": [{"step": 0, "accuracy": 0.36, "elapsed": 0.0}, {"step": 5, "accuracy": 0.5, "elapsed": 51.0}, ...]}

``elapsed`` is training seconds since the run's first step started (checkpoint writing for the evaluator and
the evaluation itself excluded), or None where it was not recorded (such a run counts in the tables by step
and is left out of those by seconds); a run's ``steps`` may be empty where its per-step log was lost (it then
counts only in the accuracy tables). Accuracy at a wall-clock budget ``t`` is that of the run's last evaluated
checkpoint written within ``t`` seconds (a step function: what a user stopping at ``t`` would have).
"""

import itertools
import math
import statistics
from typing import Any, Dict, Iterable, List, Optional, Sequence

SIDES = ("ours", "trl")
SIDE_LABELS = {"ours": "ours", "trl": "TRL"}
TRAIN_KEYS = ("reward", "entropy", "response_length", "grad_norm", "seconds")


def spread(values: Iterable[float]) -> Dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min, max and count of ``values``."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return {"mean": float("nan"), "std": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return {"mean": statistics.fmean(vals), "std": std, "min": min(vals), "max": max(vals), "n": len(vals)}


def side_runs(runs: Sequence[Dict[str, Any]], side: str) -> List[Dict[str, Any]]:
    return [r for r in runs if r["side"] == side]


def eval_steps(runs: Sequence[Dict[str, Any]]) -> List[int]:
    """Every step at which some run was evaluated, ascending."""
    return sorted({e["step"] for r in runs for e in r["evals"]})


def accuracy_by_step(runs: Sequence[Dict[str, Any]], side: str) -> Dict[int, Dict[str, float]]:
    """Step -> spread over the side's seeds of held-out accuracy at that step (runs evaluated there)."""
    mine = side_runs(runs, side)
    out = {}
    for step in eval_steps(mine):
        out[step] = spread(e["accuracy"] for r in mine for e in r["evals"] if e["step"] == step)
        out[step]["elapsed"] = spread(e["elapsed"] for r in mine for e in r["evals"] if e["step"] == step)["mean"]
    return out


def has_clock(run: Dict[str, Any]) -> bool:
    """Whether every evaluation of ``run`` has its training seconds."""
    return all(e.get("elapsed") is not None for e in run["evals"])


def accuracy_at_seconds(run: Dict[str, Any], seconds: float) -> Optional[float]:
    """Accuracy of the run's last checkpoint evaluated at ``elapsed <= seconds`` (None if there is none, or if
    the run's clock was not recorded)."""
    if not has_clock(run):
        return None
    done = [e for e in run["evals"] if e["elapsed"] <= seconds]
    return max(done, key=lambda e: e["elapsed"])["accuracy"] if done else None


def seconds_grid(runs: Sequence[Dict[str, Any]], points: int = 6) -> List[float]:
    """``points`` evenly spaced budgets from 0 to the longest run's last evaluation, rounded to seconds."""
    longest = max((e["elapsed"] for r in runs if has_clock(r) for e in r["evals"]), default=0.0)
    return [round(longest * i / (points - 1)) for i in range(points)] if points > 1 else [round(longest)]


def accuracy_by_seconds(
    runs: Sequence[Dict[str, Any]], side: str, grid: Sequence[float]
) -> Dict[float, Dict[str, float]]:
    """Budget -> spread over the side's seeds of :func:`accuracy_at_seconds`."""
    mine = side_runs(runs, side)
    return {t: spread(accuracy_at_seconds(r, t) for r in mine) for t in grid}


def train_metric_window(
    runs: Sequence[Dict[str, Any]], side: str, key: str, first: int, last: int
) -> Dict[str, float]:
    """Spread over seeds of each run's mean ``key`` over steps ``first..last`` (inclusive)."""
    per_run = []
    for r in side_runs(runs, side):
        vals = [s[key] for s in r["steps"] if first <= s["step"] <= last and s.get(key) is not None]
        if vals:
            per_run.append(statistics.fmean(vals))
    return spread(per_run)


def train_metric_by_step(runs: Sequence[Dict[str, Any]], side: str, key: str) -> Dict[int, Dict[str, float]]:
    """Step -> spread over the side's seeds of the per-step training metric ``key``."""
    mine = side_runs(runs, side)
    steps = sorted({s["step"] for r in mine for s in r["steps"]})
    return {k: spread(s[key] for r in mine for s in r["steps"] if s["step"] == k and key in s) for k in steps}


def run_score(run: Dict[str, Any], first: int, last: int) -> Optional[float]:
    """Mean held-out accuracy of ``run`` over its evaluations at steps ``first..last`` (None if none)."""
    vals = [e["accuracy"] for e in run["evals"] if first <= e["step"] <= last]
    return statistics.fmean(vals) if vals else None


def permutation_test(a: Sequence[float], b: Sequence[float]) -> Dict[str, float]:
    """Exact two-sided permutation test of ``mean(a) - mean(b)`` over every relabelling of the pooled values.

    With seeds as the unit (a run's score is one value), this asks how often splitting the ``len(a) +
    len(b)`` scores into groups of those sizes at random gives a difference at least as large as the one seen
    (Fisher, *The Design of Experiments*, 1935). 5 + 5 seeds give C(10, 5) = 252 splits, so the smallest
    possible p is 2/252 ~= 0.008.

    Args:
        a (Sequence[float]): one score per seed, first side.
        b (Sequence[float]): one score per seed, second side.

    Returns:
        Dict[str, float]: ``diff`` (mean(a) - mean(b)), ``p`` (two-sided) and ``splits`` (how many).
    """
    pooled = list(a) + list(b)
    n, total = len(a), sum(pooled)
    observed = statistics.fmean(a) - statistics.fmean(b)
    as_large = splits = 0
    for chosen in itertools.combinations(range(len(pooled)), n):
        sum_a = sum(pooled[i] for i in chosen)
        diff = sum_a / n - (total - sum_a) / len(b)
        as_large += abs(diff) >= abs(observed) - 1e-12  # ties count: float sums of the same values
        splits += 1
    return {"diff": observed, "p": as_large / splits, "splits": splits}


def seed_noise_rows(runs: Sequence[Dict[str, Any]], windows: Sequence[tuple]) -> List[str]:
    """Markdown rows: ours - TRL per score window, with the permutation p over seeds (both sides needed)."""
    rows = []
    for first, last in windows:
        scores = {}
        for side in SIDES:
            vals = [run_score(r, first, last) for r in side_runs(runs, side)]
            scores[side] = [v for v in vals if v is not None]
        if len(scores["ours"]) < 2 or len(scores["trl"]) < 2:
            continue
        test = permutation_test(scores["ours"], scores["trl"])
        label = f"step {first}" if first == last else f"mean of steps {first}-{last}"
        rows.append(f"| {label} | {statistics.fmean(scores['ours']):.3f} | {statistics.fmean(scores['trl']):.3f} "
                    f"| {test['diff']:+.3f} | {test['p']:.2f} ({test['splits']} splits) |")
    return rows


def cell(s: Dict[str, float], digits: int = 2) -> str:
    if not s["n"]:
        return "-"
    text = f"{s['mean']:.{digits}f}"
    if s["n"] > 1:
        text += f" ± {s['std']:.{digits}f} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"
    return text


def markdown_report(runs: Sequence[Dict[str, Any]], note: str = "") -> str:
    """Accuracy vs step, accuracy vs wall-clock, and training metrics per evaluation window, as markdown.

    Cells are ``mean ± std [min, max]`` over seeds (just the mean for one seed).
    """
    sides = [s for s in SIDES if side_runs(runs, s)]
    seeds = {s: sorted({r["seed"] for r in side_runs(runs, s)}) for s in sides}
    lines = []
    if note:
        lines += [note, ""]
    lines.append("Seeds: " + "; ".join(f"{SIDE_LABELS[s]} {seeds[s]}" for s in sides) + ".")
    lines += ["", "**Held-out greedy accuracy vs optimizer step** (mean ± std [min, max] over seeds; "
              "training seconds to reach the step in parentheses)", ""]
    lines.append("| step | " + " | ".join(SIDE_LABELS[s] for s in sides) + " |")
    lines.append("|---|" + "---|" * len(sides))
    by_step = {s: accuracy_by_step(runs, s) for s in sides}
    for step in eval_steps(runs):
        cells = []
        for s in sides:
            a = by_step[s].get(step)
            if a is None:
                cells.append("-")
                continue
            clock = "" if math.isnan(a["elapsed"]) else f" ({a['elapsed']:.0f} s)"
            cells.append(f"{cell(a)}{clock}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")

    grid = seconds_grid(runs)
    clocked = "; ".join(f"{SIDE_LABELS[s]} {sorted(r['seed'] for r in side_runs(runs, s) if has_clock(r))}"
                        for s in sides)
    lines += ["", "**Held-out greedy accuracy vs training wall-clock** (the last checkpoint evaluated within "
              f"the budget; a run that ended earlier keeps its final accuracy; seeds with a recorded clock: {clocked})",
              ""]
    lines.append("| seconds | " + " | ".join(SIDE_LABELS[s] for s in sides) + " |")
    lines.append("|---|" + "---|" * len(sides))
    by_time = {s: accuracy_by_seconds(runs, s, grid) for s in sides}
    for t in grid:
        lines.append(f"| {t:.0f} | " + " | ".join(cell(by_time[s][t]) for s in sides) + " |")

    last_step = max(eval_steps(runs), default=0)
    noise = seed_noise_rows(runs, [(last_step, last_step), (5, last_step)])
    if noise:
        lines += ["", "**Ours - TRL beyond seed noise?** One score per seed; exact permutation test over seed "
                  "labels (two-sided)", "", "| score | ours | TRL | difference | p |", "|---|---|---|---|---|"]
        lines += noise

    logged = "; ".join(f"{SIDE_LABELS[s]} {sorted(r['seed'] for r in side_runs(runs, s) if r['steps'])}"
                       for s in sides)
    lines += ["", f"**Training metrics**, mean over the steps of each window, then over seeds (seeds with a "
              f"per-step log: {logged})", ""]
    header = "| steps | side | reward | entropy | response length | grad norm | s/step |"
    lines += [header, "|---|---|---|---|---|---|---|"]
    bounds = [e for e in eval_steps(runs) if e > 0]
    first = 1
    for last in bounds:
        for s in sides:
            cells = [cell(train_metric_window(runs, s, k, first, last), 3 if k != "seconds" else 1)
                     for k in TRAIN_KEYS]
            lines.append(f"| {first}-{last} | {SIDE_LABELS[s]} | " + " | ".join(cells) + " |")
        first = last + 1
    return "\n".join(lines)


def plot(runs: Sequence[Dict[str, Any]], path: str, title: str = "") -> None:
    """Accuracy vs step and vs seconds, entropy and reward vs step: mean lines, min-max bands, both sides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [s for s in SIDES if side_runs(runs, s)]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    colors = {"ours": "tab:blue", "trl": "tab:orange"}
    grid = seconds_grid(runs, points=25)
    for s in sides:
        label = SIDE_LABELS[s]
        panels = [
            (axes[0][0], accuracy_by_step(runs, s)),
            (axes[0][1], accuracy_by_seconds(runs, s, grid)),
            (axes[1][0], train_metric_by_step(runs, s, "entropy")),
            (axes[1][1], train_metric_by_step(runs, s, "reward")),
        ]
        for ax, series in panels:
            xs = [x for x in series if series[x]["n"]]
            ax.plot(xs, [series[x]["mean"] for x in xs], color=colors[s], label=label,
                    drawstyle="steps-post" if ax is axes[0][1] else "default", marker="o" if ax is axes[0][0] else None)
            ax.fill_between(xs, [series[x]["min"] for x in xs], [series[x]["max"] for x in xs], color=colors[s],
                            alpha=0.2, step="post" if ax is axes[0][1] else None)
    axes[0][0].set(xlabel="optimizer step", ylabel="held-out greedy accuracy")
    axes[0][1].set(xlabel="training seconds", ylabel="held-out greedy accuracy")
    axes[1][0].set(xlabel="optimizer step", ylabel="policy entropy (nats/token)")
    axes[1][1].set(xlabel="optimizer step", ylabel="training reward (mean)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title or "GRPO on SmolLM2-135M-Instruct: mean over seeds, band = min-max")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(runs: Sequence[Dict[str, Any]], out: Any, note: str = "") -> str:
    """Write ``out/report.md`` (:func:`markdown_report`) and ``out/learning.png`` (:func:`plot`); return the report."""
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = markdown_report(runs, note)
    (out / "report.md").write_text(report + "\n")
    plot(runs, str(out / "learning.png"))
    return report


def main(argv: Optional[List[str]] = None) -> None:
    """``python benchmarks/learning_report.py RUNS.json [RUNS2.json ...] --out DIR``: report.md and learning.png."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("runs", nargs="+", help="runs.json files of learning_vs_trl.py (merged; later files win)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30, help="keep runs of this many steps")
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    merged: Dict[tuple, Dict[str, Any]] = {}
    for path in args.runs:
        for run in json.loads(Path(path).read_text()):
            if run["steps_requested"] == args.steps:
                merged[(run["side"], run["seed"])] = run
    print(write_report([merged[k] for k in sorted(merged)], args.out, args.note))


if __name__ == "__main__":
    main()
