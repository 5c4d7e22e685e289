"""The cross-over behind the late learning gap against TRL (docs/benchmarks/closed_loop.md): several arms of
``benchmarks/learning_vs_trl.py``, compared seed by seed.

Every arm is a set of runs (``runs.json`` of ``learning_vs_trl.py``) with the benchmark's settings; a seed
fixes the train prompts' order on every arm, so arms are compared **paired**, seed by seed (the difference of
two arms' scores on one seed has the prompt order's part of the noise removed). Arms, e.g.:

- ``native``: our recipe with its native engine (the existing runs);
- ``transformers``: our recipe sampling with transformers' ``generate`` (``TransformersGenerator``, the sampler
  TRL uses), everything else the same;
- ``trl``: TRL's GRPOTrainer.

    python benchmarks/learning_crossover.py \
        --arm native=benchmarks/results/learning_vs_trl/runs_recorded.json:ours \
        --arm native=benchmarks/results/learning_vs_trl/runs.json:ours \
        --arm trl=benchmarks/results/learning_vs_trl/runs_recorded.json:trl \
        --arm trl=benchmarks/results/learning_vs_trl/runs.json:trl \
        --arm transformers=results/crossover/transformers/runs.json:ours --out results/crossover

``--arm NAME=FILE:SIDE`` adds the runs of ``FILE`` whose ``side`` is ``SIDE`` to arm ``NAME`` (repeatable; a
seed given twice keeps the first). Output (``crossover.md``, and ``crossover.png`` with the per-step plots):
held-out accuracy per arm and evaluation step; each pair of arms' paired differences (step 30 and the mean over steps 5-30) with an exact sign-flip test
over seeds; with ``--loop NAME=ARM,ARM,...``, the same for *loops* pooled from arms that share a training
loop (every run kept, a permutation test stratified by seed); and, for arms with per-step logs, the closed-loop diagnostics per 5-step window with the first
window where two arms part by more than twice the standard error of their seed-paired difference.
"""

import argparse
import itertools
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import learning_report

DIAGNOSTICS = ("reward", "entropy", "response_length", "zero_std_fraction", "advantage/abs_mean",
               "diagnostics/kl_step", "diagnostics/sampled_accuracy", "diagnostics/greedy_accuracy", "grad_norm")
WINDOWS = [(1, 5), (6, 10), (11, 15), (16, 20), (21, 25), (26, 30)]


def load_arms(specs: Sequence[str]) -> Dict[str, Dict[int, Dict[str, Any]]]:
    """``NAME=FILE:SIDE`` specs -> arm name -> seed -> run (the first run of a seed wins)."""
    arms: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        path, _, side = rest.rpartition(":")
        if not name or not path or not side:
            raise ValueError(f"--arm {spec!r}: expected NAME=FILE:SIDE")
        for run in json.loads(Path(path).read_text()):
            if run["side"] == side:
                arms.setdefault(name, {}).setdefault(int(run["seed"]), run)
    return arms


def sign_flip_test(diffs: Sequence[float]) -> Dict[str, float]:
    """Exact two-sided sign-flip test of ``mean(diffs) = 0`` for paired differences (one per seed).

    Under the null the sign of each seed's difference is a coin flip; the p-value is the fraction of the
    ``2^n`` sign assignments whose mean is at least as far from 0 as the one seen (Fisher 1935). 5 seeds give
    32 assignments, so the smallest possible p is 2/32 = 0.0625.
    """
    observed = abs(statistics.fmean(diffs))
    as_large = total = 0
    for signs in itertools.product((1, -1), repeat=len(diffs)):
        total += 1
        as_large += abs(statistics.fmean(s * d for s, d in zip(signs, diffs))) >= observed - 1e-12
    return {"diff": statistics.fmean(diffs), "p": as_large / total, "n": len(diffs)}


def accuracy_at(run: Dict[str, Any], step: int) -> Optional[float]:
    return next((e["accuracy"] for e in run["evals"] if e["step"] == step), None)


def window_mean(run: Dict[str, Any], key: str, first: int, last: int) -> Optional[float]:
    vals = [s[key] for s in run.get("steps", []) if first <= s["step"] <= last and s.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def paired(a: Dict[int, Dict[str, Any]], b: Dict[int, Dict[str, Any]], score) -> List[Tuple[int, float]]:
    """``(seed, score(a) - score(b))`` for the seeds both arms ran and both scored."""
    out = []
    for seed in sorted(set(a) & set(b)):
        x, y = score(a[seed]), score(b[seed])
        if x is not None and y is not None:
            out.append((seed, x - y))
    return out


def stratified_permutation_test(a: Dict[int, List[float]], b: Dict[int, List[float]], permutations: int = 20000,
                                seed: int = 0) -> Dict[str, float]:
    """Two-sided permutation test of "loop a scores as loop b" with every run kept, stratified by seed.

    The statistic is the mean over the seeds both ran of (mean of a's runs on the seed - mean of b's). Under
    the null the runs of one seed are exchangeable between the loops (same prompt order, independent random
    streams), so each permutation reshuffles the labels *within* every seed, keeping each seed's counts;
    ``p`` is the fraction of ``permutations`` random relabellings (plus the observed one) whose statistic is
    at least as far from 0 (Good 2005, *Permutation, Parametric and Bootstrap Tests of Hypotheses*, 3.6).

    Args:
        a (Dict[int, List[float]]): seed -> loop a's run scores on that seed.
        b (Dict[int, List[float]]): seed -> loop b's run scores.
        permutations (int): random relabellings. Default is 20000.
        seed (int): seeds the relabellings. Default is 0.

    Returns:
        Dict[str, float]: ``diff`` (the statistic), ``p`` and ``n`` (seeds).
    """
    import random

    seeds = sorted(set(a) & set(b))
    strata = [(a[s] + b[s], len(a[s])) for s in seeds]

    def statistic(split) -> float:
        return statistics.fmean(statistics.fmean(v[:k]) - statistics.fmean(v[k:]) for v, k in split)

    observed = statistic(strata)
    rng = random.Random(seed)
    as_large = 1
    for _ in range(permutations):
        shuffled = [(rng.sample(v, len(v)), k) for v, k in strata]
        as_large += abs(statistic(shuffled)) >= abs(observed) - 1e-12
    return {"diff": observed, "p": as_large / (permutations + 1), "n": len(seeds)}


def loop_scores(loop: Sequence[Dict[int, Dict[str, Any]]], score) -> Dict[int, List[float]]:
    """A *loop* pooled from several arms (same training loop, other samplers or random streams: independent
    draws of that loop on a seed's prompt order): seed -> ``score`` of each of its runs on that seed."""
    scores: Dict[int, List[float]] = {}
    for arm in loop:
        for seed, run in arm.items():
            value = score(run)
            if value is not None:
                scores.setdefault(seed, []).append(value)
    return scores


def pooled(loop_a: Sequence[Dict[int, Dict[str, Any]]], loop_b: Sequence[Dict[int, Dict[str, Any]]],
           score) -> Dict[str, float]:
    """Two loops compared seed by seed with every run kept (:func:`stratified_permutation_test`)."""
    return stratified_permutation_test(loop_scores(loop_a, score), loop_scores(loop_b, score))


def loops_report(arms: Dict[str, Dict[int, Dict[str, Any]]], loops: Dict[str, List[str]]) -> List[str]:
    """The pooled comparison of every pair of ``loops`` (name -> arm names), as markdown lines."""
    lines = ["", "## Loops pooled over their arms (every run kept; permutation test stratified by seed)", "",
             "| loop | arms | runs | step 30 | mean of steps 5-30 |", "|---|---|---|---|---|"]
    for name, members in loops.items():
        runs = [r for m in members for r in arms[m].values()]
        last = learning_report.spread(accuracy_at(r, 30) for r in runs)
        mean = learning_report.spread(learning_report.run_score(r, 5, 30) for r in runs)
        lines.append(f"| {name} | {', '.join(members)} | {len(runs)} | {learning_report.cell(last)} | "
                     f"{learning_report.cell(mean, 3)} |")
    lines += ["", "| a - b | seeds | step 30: diff (p) | steps 5-30: diff (p) |", "|---|---|---|---|"]
    for a, b in itertools.combinations(loops, 2):
        la, lb = [arms[m] for m in loops[a]], [arms[m] for m in loops[b]]
        t_last = pooled(la, lb, lambda r: accuracy_at(r, 30))
        t_mean = pooled(la, lb, lambda r: learning_report.run_score(r, 5, 30))
        if t_mean["n"] < 2:
            continue
        lines.append(f"| {a} - {b} | {t_mean['n']} | {t_last['diff']:+.3f} ({t_last['p']:.3f}) | "
                     f"{t_mean['diff']:+.3f} ({t_mean['p']:.3f}) |")
    return lines


def parting(a, b, key: str) -> str:
    """Where arms ``a`` and ``b`` first differ in ``key`` by more than 2 standard errors of the seed-paired
    differences (per window), said in words; windows with fewer than 3 paired seeds are not judged."""
    judged = 0
    for first, last in WINDOWS:
        diffs = [d for _, d in paired(a, b, lambda r: window_mean(r, key, first, last))]
        if len(diffs) < 3:
            continue
        judged += 1
        mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
        if abs(mean) > 2 * se:
            return f"first apart in steps {first}-{last}: {mean:+.3f} (SE {se:.3f}, {len(diffs)} paired seeds)"
    if not judged:
        return "fewer than 3 paired seeds with this quantity logged: not judged"
    return f"no window apart by > 2 SE ({judged} windows judged)"


def report(arms: Dict[str, Dict[int, Dict[str, Any]]], loops: Optional[Dict[str, List[str]]] = None) -> str:
    names = list(arms)
    steps = sorted({e["step"] for arm in arms.values() for r in arm.values() for e in r["evals"]})
    lines = ["# Cross-over: held-out accuracy per arm", "",
             "| arm | seeds | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|---|" + "---|" * len(steps)]
    for name in names:
        cells = [learning_report.cell(learning_report.spread(accuracy_at(r, s) for r in arms[name].values()))
                 for s in steps]
        lines.append(f"| {name} | {sorted(arms[name])} | " + " | ".join(cells) + " |")
    lines += ["", "Per seed (step 30; mean over steps 5-30):", "",
              "| arm | " + " | ".join(f"seed {s}" for s in sorted({s for a in arms.values() for s in a})) + " |",
              "|---|" + "---|" * len({s for a in arms.values() for s in a})]
    all_seeds = sorted({s for a in arms.values() for s in a})
    for name in names:
        cells = []
        for seed in all_seeds:
            run = arms[name].get(seed)
            cells.append("" if run is None else
                         f"{accuracy_at(run, 30):.3f}; {learning_report.run_score(run, 5, 30):.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Paired differences (same seed = same prompt order)", "",
              "| a - b | seeds | step 30: mean diff (p) | steps 5-30: mean diff (p) |", "|---|---|---|---|"]
    for a, b in itertools.combinations(names, 2):
        last = paired(arms[a], arms[b], lambda r: accuracy_at(r, 30))
        mean = paired(arms[a], arms[b], lambda r: learning_report.run_score(r, 5, 30))
        if len(mean) < 2:
            continue
        t_last, t_mean = sign_flip_test([d for _, d in last]), sign_flip_test([d for _, d in mean])
        lines.append(f"| {a} - {b} | {[s for s, _ in mean]} | {t_last['diff']:+.3f} ({t_last['p']:.2f}) | "
                     f"{t_mean['diff']:+.3f} ({t_mean['p']:.2f}) |")
    if loops:
        lines += loops_report(arms, loops)
    logged = [n for n in names if any(r.get("steps") for r in arms[n].values())]  # arms with per-step logs
    if logged:
        lines += ["", "## Closed-loop diagnostics per window (mean over seeds)", ""]
        for key in DIAGNOSTICS:
            rows = [(n, [learning_report.spread(window_mean(r, key, f, l) for r in arms[n].values()) for f, l in WINDOWS])
                    for n in logged]
            rows = [(n, cells) for n, cells in rows if any(c["n"] for c in cells)]
            if not rows:
                continue
            lines += [f"**{key}**", "", "| arm | " + " | ".join(f"{f}-{l}" for f, l in WINDOWS) + " |",
                      "|---|" + "---|" * len(WINDOWS)]
            for n, cells in rows:
                lines.append(f"| {n} | " + " | ".join(learning_report.cell(c, 3) for c in cells) + " |")
            for (a, _), (b, _) in itertools.combinations(rows, 2):
                lines.append(f"\n{a} vs {b}: {parting(arms[a], arms[b], key)}")
            lines.append("")
    return "\n".join(lines) + "\n"


def step_means(arm: Dict[int, Dict[str, Any]], key: str) -> Tuple[List[int], List[float]]:
    """Steps and the mean over the arm's seeds of ``key`` logged at each step (steps no seed logged left out)."""
    by_step: Dict[int, List[float]] = {}
    for run in arm.values():
        for rec in run.get("steps", []):
            if rec.get(key) is not None:
                by_step.setdefault(rec["step"], []).append(rec[key])
    steps = sorted(by_step)
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def plot(arms: Dict[str, Dict[int, Dict[str, Any]]], path: Path) -> None:
    """Held-out accuracy per evaluation and each closed-loop diagnostic per step: one line per arm, the mean
    over its seeds (diagnostics an arm did not log are left out of its panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["held-out accuracy", *DIAGNOSTICS]
    cols = 4
    fig, axes = plt.subplots(-(-len(keys) // cols), cols, figsize=(4 * cols, 3.2 * -(-len(keys) // cols)))
    for ax, key in zip(axes.flat, keys):
        for name, arm in arms.items():
            if key == "held-out accuracy":
                steps = sorted({e["step"] for r in arm.values() for e in r["evals"]})
                values = [statistics.fmean(v for v in (accuracy_at(r, s) for r in arm.values()) if v is not None)
                          for s in steps]
                ax.plot(steps, values, marker="o", label=name)
            else:
                steps, values = step_means(arm, key)
                if steps:
                    ax.plot(steps, values, label=name, linewidth=1.2)
        ax.set(title=key, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("Cross-over: mean over seeds per arm (SmolLM2-135M, benchmarks/learning_vs_trl.py settings)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", action="append", required=True, metavar="NAME=FILE:SIDE")
    parser.add_argument("--loop", action="append", default=[], metavar="NAME=ARM,ARM,...",
                        help="pool arms that share a training loop (repeatable); loops are compared seed by seed")
    parser.add_argument("--out", default=None, help="directory for crossover.md")
    args = parser.parse_args(argv)
    arms = load_arms(args.arm)
    loops: Dict[str, List[str]] = {}
    for spec in args.loop:
        name, _, members = spec.partition("=")
        loops[name] = [m for m in members.split(",") if m]
        unknown = [m for m in loops[name] if m not in arms]
        if not name or not loops[name] or unknown:
            raise ValueError(f"--loop {spec!r}: expected NAME=ARM,ARM,... naming --arm arms (unknown: {unknown})")
    text = report(arms, loops)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "crossover.md").write_text(text)
        plot(load_arms(args.arm), Path(args.out) / "crossover.png")
    print(text)
    return text


if __name__ == "__main__":
    main()
