"""The GRPO algorithm family through the recipe: split independence of every loss variant, the presets,
dynamic sampling with resumption, and the algorithm card.

One-process runs go in process (tests.recipe_utils.run_in_process: no `tune run` start-up, 10-20 s each on
2 loaded cores); the two-process runs and the split runs' one-process references in one launch of two processes
for the whole file (tests/_spawn_runs.py; `tune run --nproc_per_node 2` end to end: tests/test_distributed_runs.py).
Checks are batched so that each run covers several variants (see tests/_losses.py).
"""

import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests._spawn_runs import launch as spawn_launch, log_of, Run
from tests.conftest import REPO
from tests.recipe_utils import REQUIRED_METRICS, read_jsonl, recipe_in_process, run_in_process, weights, write_config
from torchtune_grpo.assets import asset_path

PRESETS = ["grpo", "dr_grpo", "dapo", "gspo"]

# One loss variant per step (tests/_losses.py): the four aggregation modes, GSPO's sequence ratio with its
# tiny clip range, token-mean with the KL term (k3+), dual clip and an entropy bonus, then CISPO, GMPO, SAPO.
VARIANTS = [
    {"loss_agg_mode": "token-mean", "kl_coef": 0.0},
    {"loss_agg_mode": "seq-mean-token-mean", "kl_coef": 0.0},
    {"loss_agg_mode": "seq-mean-token-sum", "kl_coef": 0.0},
    {"loss_agg_mode": "seq-mean-token-sum-norm", "kl_coef": 0.0},
    {"loss_agg_mode": "seq-mean-token-mean", "ratio_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4,
     "kl_coef": 0.0},
    {"loss_agg_mode": "token-mean", "dual_clip": 1.5, "entropy_coef": 0.01, "epsilon": 0.05},
    # CISPO, GMPO and SAPO, each in another aggregation mode (the KL term k3+ from the recipe)
    {"_class": "CISPOLoss", "loss_agg_mode": "token-mean", "epsilon_high": 0.01, "epsilon_low": 0.01},
    {"_class": "GMPOLoss", "loss_agg_mode": "seq-mean-token-mean", "epsilon": 0.01},
    {"_class": "SAPOLoss", "loss_agg_mode": "seq-mean-token-sum-norm", "tau_neg": 2.0},
]


def _split_config(run_dir: Path, batch_size: int, micro_batch_size: int, **overrides) -> Path:
    # Deterministic rollouts (tests/_engines.py) and shuffle=False: rank r of W takes prompts r, r+W, ...,
    # so W processes x batch_size b train on the same global set of prompts as 1 process x W*b.
    return write_config(
        run_dir,
        **overrides,
        vowel_reward=False,
        max_steps=len(VARIANTS),
        save_every_n_steps=1,
        shuffle=False,
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        # the engine reports scripted sampling logprobs, so the rollout correction (vLLM's) acts: token
        # masks (two-sided) and off-policy sequence masks, decided before the update, shrink the global counts
        generation={"_component_": "tests._engines.ScriptedGenerator", "logprob_center": -6.2},
        rollout_correction={"level": "token", "mode": "mask", "upper": 1.3, "lower": 0.75,
                            "offpolicy_threshold": 0.05},
        # A step-level reward (weight 0: the outcome total stays EvenTokenReward's) whose steps give token-level
        # advantages at even steps: process-supervised advantages go through every second loss variant, the
        # rollout correction's sequence masks, the micro-batches, the packed rows and the ranks.
        reward_functions=[
            {"_component_": "tests._rewards.EvenTokenReward"},
            {"_component_": "torchtune_grpo.rewards.PythonStepReward", "function": "tests._rewards.vowel_step",
             "steps": {"function": "tests._rewards.every_third_token"}, "aggregate": "mean", "weight": 0.0},
        ],
        advantage={"_component_": "tests._losses.StepCyclingAdvantage", "estimators": [
            {"_component_": "torchtune_grpo.rollouts.advantages.BatchStdAdvantage"},  # needs global stats
            {"_component_": "torchtune_grpo.rollouts.process_advantages.ProcessSupervisedAdvantage",
             "outcome_weight": 1.0},
        ]},
        loss={"_component_": "tests._losses.StepCyclingLoss", "variants": VARIANTS},
        kl_coef=0.05,
        kl_estimator="k3+",
        mask_truncated_completions=True,  # global token/sequence counts change with the mask
        ppo_epochs=2,  # 2 passes x 2 mini-batches: updates 2-4 are off-policy (ratios, clipping, dual clip act)
        # Each mini-batch is normalised by its own global counts. In rollout order (no shuffle) mini-batch m of
        # a step holds the first or second half of each rank's groups: with 1 process x 4 groups, groups {0, 1}
        # then {2, 3}; with 2 processes x 2 (rank r's group j is global group r + 2j), {0, 1} then {2, 3}: the
        # same mini-batches. (The seeded shuffle is per rank, so it differs between 1 and 2 processes:
        # tests/test_update.py checks it.)
        ppo_mini_batches=2,
        ppo_mini_batch_shuffle=False,
        optimizer={"_component_": "torch.optim.SGD", "lr": 0.05},
        lr_scheduler=None,
        clip_grad_norm=None,  # the update is the raw gradient
    )


# Every two-process run of this file, and the one-process references of the split runs, in ONE launch of two
# processes (tests/_spawn_runs.py): one start-up of torch and the recipe per process instead of three per
# `tune run --nproc_per_node 2`, and the one-process runs side by side on the two processes.
# The launch's processes take the one-process runs in this order, each the next one when it is free: D (its
# token-budget micro-batches: ~4.5 s) first, then A and B (~2 s each) one after the other on the other process.
SPLIT_RUNS = {  # name: (processes, batch_size, micro_batch_size, overrides)
    "D": (1, 4, 16, {"max_tokens_per_micro_batch": 96}),
    "A": (1, 4, 16, {}), "B": (1, 4, 4, {}), "C": (2, 2, 8, {"max_tokens_per_micro_batch": 96}),
    "E": (2, 2, 8, {"max_tokens_per_micro_batch": 96, "share_prompt_in_training": False,
                    "pack_sequences_in_training": True}),
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The runs of SPLIT_RUNS and the DAPO preset's two-process run, done once for this file's tests; returns
    the directory that holds one folder per run."""
    root = tmp_path_factory.mktemp("launch")
    runs = []
    for name, (nproc, batch_size, mbs, overrides) in SPLIT_RUNS.items():
        (root / name).mkdir()
        config = str(_split_config(root / name, batch_size, mbs, **overrides))
        runs.append(Run(two_processes=config) if nproc == 2 else Run(one_process=config))
    # The DAPO preset: dynamic sampling's cross-rank round agreement needs 2 ranks.
    cfg = OmegaConf.load(REPO / "configs" / "algorithms" / "dapo_tiny.yaml")
    cfg.output_dir = str(root / "dapo" / "out")
    cfg.max_steps, cfg.save_every_n_steps = 2, None
    (root / "dapo").mkdir()
    OmegaConf.save(cfg, root / "dapo" / "config.yaml")
    runs.append(Run(two_processes=str(root / "dapo" / "config.yaml")))
    spawn_launch(runs)
    return root


@pytest.mark.slow
def test_every_variant_is_independent_of_micro_batches_and_processes(launch):
    # 16 sequences per step: A = 1 process, 1 micro-batch; B = 1 process, 4 micro-batches;
    # C = 2 processes of 8 sequences and D = 1 process, both with token-budget micro-batches
    # (max_tokens_per_micro_batch: sorted by length, groups split where one is over the budget, and on 2
    # processes as many micro-batches on each rank); E = 2 processes with packed rows under the budget (every
    # sequence of a rank's step packed into rows as wide as its longest, micro-batches of whole rows). Weights
    # after every step must agree. (A shared row of 4 completions is ~130 tokens here, over the budget of 96.)
    results = {}
    for name, (nproc, *_rest) in SPLIT_RUNS.items():
        run_dir = launch / name
        assert f"{nproc} rank(s)" in log_of(run_dir / "config.yaml")
        out = run_dir / "out"
        results[name] = [weights(out / f"step_{k}") for k in range(1, len(VARIANTS) + 1)]
        results[name + "_metrics"] = read_jsonl(out / "metrics.jsonl")

    metrics = results["A_metrics"]
    assert any(0 < m["truncated_fraction"] < 1 for m in metrics)  # the mask really removes sequences
    assert any(m["clip_fraction"] > 0 for m in metrics)
    assert metrics[-1]["kl"] > 0 and metrics[-1]["entropy"] > 0
    assert all(0 < m["rollout_correction/masked_fraction"] < 1 for m in metrics)
    assert any(m["rollout_correction/seq_masked_fraction"] > 0 for m in metrics)
    before = weights(Path(asset_path("tiny_qwen2")))
    for k, variant in enumerate(VARIANTS):
        prev = before if k == 0 else results["A"][k - 1]
        step_change = max((results["A"][k][key] - prev[key]).abs().max().item() for key in prev)
        assert step_change > 5e-4, f"step {k + 1} ({variant}) barely moved the weights: {step_change}"
        # The runs compute each step's gradient as the same sum of per-token terms in another grouping (micro-batches,
        # the ranks' gloo all-reduce, packed or padded rows: other matmul shapes, so logits a few ulp apart: the tiny
        # asset's |logit| <~ 2, ulp 2.4e-7). A sum of n terms regrouped differs by ~sqrt(n) ulp of its magnitude
        # (tests/tolerances.py); with SGD the weights then move by lr (0.05) x that, ~1e-8 per step at gradients of
        # O(0.1), plus one rounding of the weight (|w| <~ 0.1: 7.5e-9), over 4-7 steps without amplification at this lr.
        # Bound: 1e-5 on the weights (> 100x that); 1e-5 absolute on the logged means, the same regrouped fp32 sums
        # (~1e-6 relative at O(1)); counts and rewards are exact.
        for other in ("B", "C", "D", "E"):
            for key, value in results["A"][k].items():
                torch.testing.assert_close(
                    results[other][k][key], value, atol=1e-5, rtol=0,
                    msg=lambda m: f"run {other}, step {k + 1} ({variant}), {key}: {m}",
                )
    # Logged losses are global too (sums of micro-batch and rank contributions).
    for other in ("B", "C", "D", "E"):
        for ma, mo in zip(metrics, results[other + "_metrics"]):
            for key in ("loss", "policy_loss", "kl", "entropy", "clip_fraction", "reward/mean",
                        "rollout_correction/masked_fraction", "rollout_correction/kl"):
                assert mo[key] == pytest.approx(ma[key], abs=1e-5), (other, ma["step"], key)


def _check_tiny_preset(preset: str, out: Path, log: str) -> None:
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert REQUIRED_METRICS <= m.keys(), REQUIRED_METRICS - m.keys()
        assert math.isfinite(m["loss"]) and m["entropy"] > 0
    card = (out / "algorithm_card.md").read_text()
    assert "# Algorithm card" in card and "# Algorithm card" in log  # printed and written
    expected = {
        "grpo": ["[seq-mean-token-mean", "0.04 * k3_i,t", "/ (std(R_group)", "| reference model | loaded"],
        "dr_grpo": ["[seq-mean-token-sum-norm", "(1 / (N * 24))", "A_i = R_i - mean(R_group)", "| not loaded"],
        "dapo": ["[token-mean", "1 + 0.28", "Dynamic sampling", "soft_overlong", "masked out of the loss"],
        "gspo": ["[sequence level, GSPO]", "1 - 0.0003", "1 + 0.0004", "| 4 | ppo_epochs 1 x ppo_mini_batches 4",
                 "| prompts per optimizer step | 1 | batch_size 4 x 1 process(es) / ppo_mini_batches 4"],
    }[preset]
    for text in expected:
        assert text in card, f"{text!r} not in the card:\n{card}"
    assert (out / "step_2" / "recipe_state.pt").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "dapo"])
def test_tiny_preset_runs_two_steps_in_process(preset, tmp_path, caplog, clean_env, one_thread):
    config = REPO / "configs" / "algorithms" / f"{preset}_tiny.yaml"
    cfg = OmegaConf.load(config)
    cfg.output_dir = str(tmp_path / "out")
    cfg.max_steps, cfg.save_every_n_steps = 2, None
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    with caplog.at_level(logging.INFO):
        run_in_process(path)
    _check_tiny_preset(preset, tmp_path / "out", caplog.text)


@pytest.mark.slow
def test_dapo_preset_runs_two_steps_on_two_processes(launch):
    # Dynamic sampling's cross-rank round agreement needs 2 ranks: the preset on two processes, in the file's launch.
    out, log = launch / "dapo" / "out", log_of(launch / "dapo" / "config.yaml")
    _check_tiny_preset("dapo", out, log)
    assert "2 rank(s)" in log
    assert all(1 <= m["dynamic_sampling/rounds"] <= 3 for m in read_jsonl(out / "metrics.jsonl"))


def test_a_failed_run_fails_the_launch_with_its_output(launch, tmp_path):
    # The launch's processes are forked children judged by their exit codes: a run that raises makes the launch
    # raise with that process's traceback (here a one-process run of a config that is not there, taken by
    # whichever process asks for a run first: either may report), and a two-process run both of whose ranks fail
    # does too, instead of hanging or passing. ~1 s: the fork server is up after the file's launch.
    missing = tmp_path / "missing.yaml"
    with pytest.raises(AssertionError, match="process [01] of the launch exited 1") as failed:
        spawn_launch([Run(one_process=str(missing)), Run(two_processes=str(missing))])
    assert "missing.yaml" in str(failed.value) and "Traceback" in str(failed.value)


@pytest.mark.slow
def test_dynamic_sampling_and_kl_reward_resume_exactly(tmp_path, caplog, clean_env, one_thread):
    # Half of the prompts get a zero-variance reward (tests/_rewards.py), so dynamic sampling drops groups and
    # runs extra rounds; 24 prompts / batch 4 = 6 batches per epoch, so the extra rounds roll over epochs.
    # The KL sits in the reward. Resuming from step 2 must reproduce steps 3-4 exactly.
    cfg = write_config(
        tmp_path,
        vowel_reward=False,
        max_steps=4,
        save_every_n_steps=2,
        reward_functions=[{"_component_": "tests._rewards.HalfPromptsVowelReward"}],
        **{"dataset.num_samples": 24},
        dynamic_sampling={"enabled": True, "max_rounds": 3},
        kl_coef=0.05,
        kl_placement="reward",
        kl_estimator="k1",
    )
    with caplog.at_level(logging.INFO):
        run_in_process(cfg)
    assert "KL in the reward" in caplog.text
    out = tmp_path / "out"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert sum(m["dynamic_sampling/rounds"] for m in metrics) > len(metrics)  # extra rounds ran
    assert sum(m["dynamic_sampling/groups_dropped"] for m in metrics) > 0
    assert metrics[-1]["reward/kl_penalty"] != 0  # the policy moved away from the reference
    uninterrupted = weights(out / "step_4")

    shutil.rmtree(out / "step_4")
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in (out / "metrics.jsonl").read_text().splitlines()[:2]))
    resume = OmegaConf.load(cfg)
    resume.resume_from_checkpoint = True
    OmegaConf.save(resume, tmp_path / "resume.yaml")
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run_in_process(tmp_path / "resume.yaml")
    assert "Resuming from" in caplog.text
    resumed_metrics = read_jsonl(out / "metrics.jsonl")
    # The resumed steps are the same computation as the uninterrupted ones (weights compared exactly below): rounds and
    # drops are counts, reward/mean and loss the same fp32 sums. Bound: 1e-6 (equal in practice).
    for before, after in zip(metrics[2:], resumed_metrics[2:]):
        for key in ("dynamic_sampling/rounds", "dynamic_sampling/groups_dropped", "reward/mean", "loss"):
            assert after[key] == pytest.approx(before[key], abs=1e-6), key
    resumed = weights(out / "step_4")
    # A resumed run is the uninterrupted computation itself: weights, optimizer and LR state, RNG streams and
    # data order restored bit for bit, the same kernels on the same shapes. So it compares a computation with
    # itself: exact (formerly 1e-6 + 1e-5 relative; measured bitwise equal with AVX-512, AVX2 and scalar kernels).
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], atol=0, rtol=0)


# The 2026 presets run in-process (no `tune run` start-up: about 3 s each). The Qwen2.5-1.5B preset of each
# states the same algorithm (loss and advantage sections) as the tiny one run here.
POLICY_PRESETS = {
    "cispo": ["p_i,t = -sg(clip(r_i,t, 0, 1 + 0.28)) * A_i * log pi_theta(o_i,t)", "[token-mean"],
    "gmpo": ["min(x_i,t, 0.4) where A_i > 0, max(x_i,t, -0.4) where A_i <= 0", "p_i,t = -A_i * s_i",
             "[seq-mean-token-mean"],
    "sapo": ["tau_i = 1 where A_i > 0, 1.05 otherwise", "[seq-mean-token-mean"],
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(POLICY_PRESETS))
def test_policy_preset_runs_two_steps_in_process(preset, tmp_path, clean_env, one_thread):

    cfg = OmegaConf.load(REPO / "configs" / "algorithms" / f"{preset}_tiny.yaml")
    big = OmegaConf.load(REPO / "configs" / "qwen2_5" / f"1.5B_{preset}.yaml")
    for key in ("loss", "advantage", "kl_coef", "ppo_epochs", "ppo_mini_batches"):
        assert big[key] == cfg[key], f"1.5B_{preset}.yaml and {preset}_tiny.yaml differ in {key}"
    cfg.output_dir = str(tmp_path / "out")
    cfg.max_steps, cfg.save_every_n_steps = 2, None
    # The random tiny model scores 0 on format and correctness: a vowel reward gives nonzero advantages.
    cfg.reward_functions.append({"_component_": "tests._rewards.VowelFractionReward", "weight": 1.0})
    with recipe_in_process(cfg) as recipe:
        before = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
        recipe.train()
        changed = [k for k, v in recipe.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed, "no weight changed in 2 steps"
    metrics = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert REQUIRED_METRICS <= m.keys(), REQUIRED_METRICS - m.keys()
        assert math.isfinite(m["loss"]) and m["entropy"] > 0
    card = (tmp_path / "out" / "algorithm_card.md").read_text()
    for text in POLICY_PRESETS[preset] + ["| 2 | ppo_epochs 1 x ppo_mini_batches 2", "| not loaded"]:
        assert text in card, f"{text!r} not in the card:\n{card}"
