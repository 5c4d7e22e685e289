"""The pure aggregation of benchmarks/learning_vs_trl.py (benchmarks/learning_report.py): no model, no TRL."""


import pytest

from tests.conftest import load_benchmark

report = load_benchmark("learning_report")


def _run(side, seed, evals, entropies):
    steps = [
        {"step": i + 1, "reward": 0.5, "entropy": e, "response_length": 10.0, "grad_norm": 1.0, "seconds": 10.0,
         "elapsed": 10.0 * (i + 1)}
        for i, e in enumerate(entropies)
    ]
    return {"side": side, "seed": seed, "steps": steps,
            "evals": [{"step": s, "accuracy": a, "elapsed": t} for s, a, t in evals]}


RUNS = [
    _run("ours", 0, [(0, 0.3, 0.0), (3, 0.5, 30.0)], [1.0, 0.8, 0.6]),
    _run("ours", 1, [(0, 0.3, 0.0), (3, 0.7, 40.0)], [1.0, 0.6, 0.2]),
    _run("trl", 0, [(0, 0.3, 0.0), (3, 0.4, 60.0)], [1.0, 1.0, 1.0]),
]


def test_accuracy_by_step_is_mean_and_sample_spread_over_seeds():
    ours = report.accuracy_by_step(RUNS, "ours")
    # step 3: accuracies 0.5 and 0.7 -> mean 0.6, sample std sqrt(((-.1)^2 + .1^2) / 1) = 0.1414
    # These are float64 means, stds and sums of a few decimal inputs (0.5, 0.7, ...), each a few roundings at 1e-16
    # relative: pytest.approx's default 1e-6 relative bounds them here and below, far above any rounding; none of
    # this report's arithmetic runs through torch kernels, so the CPU capability does not enter.
    assert ours[3]["mean"] == pytest.approx(0.6)
    assert ours[3]["std"] == pytest.approx(0.02**0.5)
    assert (ours[3]["min"], ours[3]["max"], ours[3]["n"]) == (0.5, 0.7, 2)
    assert ours[3]["elapsed"] == pytest.approx(35.0)  # (30 + 40) / 2
    trl = report.accuracy_by_step(RUNS, "trl")
    assert trl[3]["std"] == 0.0 and trl[3]["n"] == 1


def test_accuracy_at_a_wall_clock_budget_is_the_last_checkpoint_evaluated_within_it():
    seed1 = RUNS[1]
    assert report.accuracy_at_seconds(seed1, 39.9) == 0.3  # step 3 was written at 40 s
    assert report.accuracy_at_seconds(seed1, 40.0) == 0.7
    assert report.accuracy_at_seconds(seed1, 1e9) == 0.7  # a finished run keeps its final accuracy
    assert report.seconds_grid(RUNS, points=4) == [0, 20, 40, 60]  # longest evaluation: TRL at 60 s
    # float64 means of decimal accuracies (a few roundings, 1e-16 relative): approx's default 1e-6 relative.
    by_time = report.accuracy_by_seconds(RUNS, "ours", [20, 40])
    assert by_time[20]["mean"] == pytest.approx(0.3)
    assert by_time[40]["mean"] == pytest.approx(0.6)
    assert report.accuracy_by_seconds(RUNS, "trl", [40])[40]["mean"] == pytest.approx(0.3)


def test_training_metric_window_averages_each_run_then_seeds():
    # steps 2-3: seed 0 entropy (0.8 + 0.6) / 2 = 0.7, seed 1 (0.6 + 0.2) / 2 = 0.4 -> mean 0.55
    # float64 means of decimal metrics: approx's default 1e-6 relative.
    w = report.train_metric_window(RUNS, "ours", "entropy", 2, 3)
    assert w["mean"] == pytest.approx(0.55)
    assert (w["min"], w["max"]) == (pytest.approx(0.4), pytest.approx(0.7))


def test_markdown_report_rows():
    text = report.markdown_report(RUNS, note="note line")
    assert text.startswith("note line")
    assert "Seeds: ours [0, 1]; TRL [0]." in text
    assert "| 3 | 0.60 ± 0.14 [0.50, 0.70] (35 s) | 0.40 (60 s) |" in text
    # wall-clock budgets: 6 points up to the longest evaluation (60 s): 0, 12, 24, 36, 48, 60
    assert "| 36 | 0.40 ± 0.14 [0.30, 0.50] | 0.30 |" in text  # at 36 s seed 0 has 0.5, seed 1 still 0.3
    assert "| 48 | 0.60 ± 0.14 [0.50, 0.70] | 0.30 |" in text
    # steps 1-3: entropy seed 0 (1 + .8 + .6) / 3 = 0.8, seed 1 (1 + .6 + .2) / 3 = 0.6 -> 0.700 ± 0.141
    assert "| 1-3 | ours | 0.500 ± 0.000 [0.500, 0.500] | 0.700 ± 0.141 [0.600, 0.800] |" in text


def test_permutation_test_by_hand():
    # pooled [1, 2, 3, 4], a = [3, 4]: diff 3.5 - 1.5 = 2; of the 6 splits only {3,4} and {1,2} reach |2|
    t = report.permutation_test([3.0, 4.0], [1.0, 2.0])
    assert (t["diff"], t["splits"]) == (2.0, 6)
    # Exact enumeration of the 6 splits: 2 / 6 to one float64 rounding.
    assert t["p"] == pytest.approx(2 / 6)
    # identical values: every split has diff 0 -> p 1
    assert report.permutation_test([0.5, 0.5], [0.5, 0.5])["p"] == 1.0


def test_seed_noise_rows_score_each_run_then_test():
    runs = [_run("ours", s, [(0, 0.3, 0.0), (3, a, 30.0)], [1.0]) for s, a in [(0, 0.9), (1, 0.8)]]
    runs += [_run("trl", s, [(0, 0.3, 0.0), (3, a, 30.0)], [1.0]) for s, a in [(0, 0.5), (1, 0.6)]]
    rows = report.seed_noise_rows(runs, [(3, 3), (0, 3)])
    # step 3: ours 0.85, TRL 0.55, diff +0.30; 6 splits, only the observed one and its mirror reach 0.30
    assert rows[0] == "| step 3 | 0.850 | 0.550 | +0.300 | 0.33 (6 splits) |"
    # steps 0-3: each run scores (0.3 + acc) / 2 -> ours 0.575, TRL 0.425
    assert rows[1].startswith("| mean of steps 0-3 | 0.575 | 0.425 | +0.150 |")
    assert report.seed_noise_rows(RUNS, [(3, 3)]) == []  # one TRL seed: no test


def test_runs_without_a_clock_or_a_step_log_count_only_where_they_have_data():
    # A run recorded by its accuracies alone (its per-step log lost): it joins the accuracy-by-step mean and
    # the permutation test, and stays out of the tables by seconds and of the training-metric windows.
    unclocked = {"side": "ours", "seed": 2, "steps": [],
                 "evals": [{"step": 0, "accuracy": 0.3, "elapsed": None}, {"step": 3, "accuracy": 0.9, "elapsed": None}]}
    # float64 means of decimal accuracies: approx's default 1e-6 relative.
    runs = RUNS + [unclocked]
    assert report.accuracy_by_step(runs, "ours")[3]["mean"] == pytest.approx(0.7)  # (0.5 + 0.7 + 0.9) / 3
    assert report.accuracy_by_step(runs, "ours")[3]["elapsed"] == pytest.approx(35.0)  # clocked seeds only
    assert report.accuracy_at_seconds(unclocked, 1e9) is None
    assert report.accuracy_by_seconds(runs, "ours", [40])[40]["n"] == 2
    assert report.seconds_grid(runs, points=4) == [0, 20, 40, 60]
    assert report.train_metric_window(runs, "ours", "entropy", 2, 3)["n"] == 2
    text = report.markdown_report(runs)
    assert "seeds with a recorded clock: ours [0, 1]; TRL [0]" in text
    assert "per-step log: ours [0, 1]; TRL [0]" in text
    assert "| 3 | 0.70 ± 0.20 [0.50, 0.90] (35 s) | 0.40 (60 s) |" in text


def test_command_line_merges_runs_files_later_ones_winning(tmp_path):
    import json

    older = [dict(RUNS[0], steps_requested=3, evals=[{"step": 0, "accuracy": 0.3, "elapsed": None},
                                                     {"step": 3, "accuracy": 0.1, "elapsed": None}])]
    newer = [dict(r, steps_requested=3) for r in RUNS] + [dict(RUNS[1], seed=9, steps_requested=5)]
    (tmp_path / "a.json").write_text(json.dumps(older))
    (tmp_path / "b.json").write_text(json.dumps(newer))
    report.main([str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "rep"), "--steps", "3"])
    text = (tmp_path / "rep" / "report.md").read_text()
    # ours seed 0 from b.json (0.5 at step 3, not a.json's 0.1) and seed 1; seed 9 ran 5 steps: left out
    assert "Seeds: ours [0, 1]; TRL [0]." in text
    assert "| 3 | 0.60 ± 0.14 [0.50, 0.70] (35 s) | 0.40 (60 s) |" in text
    assert (tmp_path / "rep" / "learning.png").stat().st_size > 10_000


crossover = load_benchmark("learning_crossover")


def test_sign_flip_test_by_hand():
    # 3 seeds, all positive: only the all-plus and all-minus assignments are as extreme: p = 2/8.
    # Exact enumeration of the 8 sign assignments (p) and a float64 mean (diff): approx's default 1e-6 relative.
    out = crossover.sign_flip_test([0.1, 0.2, 0.3])
    assert out["diff"] == pytest.approx(0.2) and out["p"] == pytest.approx(0.25) and out["n"] == 3
    # Opposite signs of equal size: every assignment is as extreme as |mean| = 0.
    assert crossover.sign_flip_test([0.5, -0.5])["p"] == 1.0


def test_crossover_pairs_seeds_and_finds_where_arms_part():
    def run(seed, acc30, entropy_late):
        steps = [{"step": s, "entropy": 1.0 if s <= 10 else entropy_late + 0.01 * seed} for s in range(1, 31)]
        return {"side": "ours", "seed": seed, "steps": steps,
                "evals": [{"step": 5, "accuracy": 0.5}, {"step": 30, "accuracy": acc30}]}

    a = {s: run(s, 0.6 + 0.01 * s, 0.2) for s in range(4)}
    b = {s: run(s, 0.8 + 0.01 * s, 0.5) for s in range(4)}
    # float64 differences of decimal accuracies: approx's default 1e-6 relative.
    diffs = crossover.paired(a, b, lambda r: crossover.accuracy_at(r, 30))
    assert [s for s, _ in diffs] == [0, 1, 2, 3] and all(d == pytest.approx(-0.2) for _, d in diffs)
    # Equal through step 10, apart from 11-15 on (every seed -0.3): the first window judged apart.
    assert crossover.parting(a, b, "entropy").startswith("first apart in steps 11-15: -0.300")
    assert crossover.parting({0: a[0]}, {0: b[0]}, "entropy").startswith("fewer than 3 paired seeds")
    text = crossover.report({"a": a, "b": b})
    assert "| a - b | [0, 1, 2, 3] | -0.200 (0.12) |" in text


def test_stratified_permutation_test_by_hand():
    # One seed, runs 0.6 and 0.4 in a, 0.1 in b: observed 0.5 - 0.1 = 0.4. The three equally likely splits
    # give 0.4, 0.35 - 0.4 = -0.05 and 0.25 - 0.6 = -0.35: only the observed one is as extreme, p = 1/3.
    out = crossover.stratified_permutation_test({0: [0.6, 0.4]}, {0: [0.1]})
    # Not rounding: p is estimated from 20000 seeded random relabellings (plus the observed one), standard error
    # sqrt(p (1 - p) / 20000) = 0.0033 at p = 1/3; 0.015 is ~4.5 standard errors (a statistical bound, and the
    # seeded draw makes it deterministic). diff is float64 arithmetic on decimal inputs (approx's default).
    assert out["diff"] == pytest.approx(0.4) and out["p"] == pytest.approx(1 / 3, abs=0.015) and out["n"] == 1
    # Labels move only within a seed: a difference carried by the seeds (a seed effect) is not a loop effect.
    same = crossover.stratified_permutation_test({0: [0.1], 1: [0.9]}, {0: [0.1], 1: [0.9]})
    assert same["diff"] == 0.0 and same["p"] == 1.0


def test_loops_pool_their_arms_and_permute_within_each_seed():
    def run(seed, acc30):
        return {"side": "ours", "seed": seed, "steps": [],
                "evals": [{"step": s, "accuracy": acc30} for s in (5, 10, 15, 20, 25, 30)]}

    # Loop X: two arms; seed 0 has both (0.5 and 0.7), seed 1 only the first (0.8).
    x1, x2 = {0: run(0, 0.5), 1: run(1, 0.8)}, {0: run(0, 0.7)}
    # Loop Y: one arm, seeds 0-2 (seed 2 has no partner in X and is left out).
    y = {0: run(0, 0.4), 1: run(1, 0.9), 2: run(2, 0.1)}
    assert crossover.loop_scores([x1, x2], lambda r: crossover.accuracy_at(r, 30)) == {0: [0.5, 0.7], 1: [0.8]}
    out = crossover.pooled([x1, x2], [y], lambda r: crossover.accuracy_at(r, 30))
    # Observed: seed 0 0.6 - 0.4, seed 1 0.8 - 0.9: mean +0.05. Seed 0's splits give 0.2, -0.25, 0.05 and seed
    # 1's -0.1, +0.1: means 0.05, 0.15, -0.175, -0.075, -0.025, 0.075, five of six as far from 0: p = 5/6.
    # 20000 seeded relabellings: standard error 0.0026 at p = 5/6, so 0.015 is ~5.7 standard errors (statistical, not
    # rounding); diff is float64 arithmetic (approx's default).
    assert out["diff"] == pytest.approx(0.05) and out["p"] == pytest.approx(5 / 6, abs=0.015) and out["n"] == 2
    text = crossover.report({"x1": x1, "x2": x2, "y": y}, loops={"X": ["x1", "x2"], "Y": ["y"]})
    assert "| X | x1, x2 | 3 |" in text and "| X - Y | 2 | +0.050 (0.8" in text


def test_crossover_command_line_refuses_a_loop_naming_an_unknown_arm(tmp_path):
    runs = tmp_path / "runs.json"
    runs.write_text('[{"side": "ours", "seed": 0, "steps": [], "evals": [{"step": 30, "accuracy": 0.5}]}]')
    with pytest.raises(ValueError, match="unknown: \\['nope'\\]"):
        crossover.main(["--arm", f"a={runs}:ours", "--loop", "L=a,nope"])
