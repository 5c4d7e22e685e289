"""Closed-loop diagnostics (torchtune_grpo/training/diagnostics.py, ``step_diagnostics``): KL before -> after on the
step's samples, sampled vs greedy accuracy, mean |advantage|; checked against the logged completions."""

import pytest
from omegaconf import OmegaConf

from tests.recipe_utils import read_jsonl, run_in_process, write_config

THRESHOLD = 0.2


def _run(tmp_path, vowel_reward=True, **overrides):
    tmp_path.mkdir()
    settings = dict(eval_reward="vowels", eval_threshold=THRESHOLD) if vowel_reward else {}
    config = write_config(tmp_path, vowel_reward=vowel_reward, max_steps=2, save_every_n_steps=None,
                          lr_scheduler=None, log_completions=64, step_diagnostics=True, **settings, **overrides)
    run_in_process(config)
    metrics = [m for m in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in m]
    rows = read_jsonl(tmp_path / "out" / "completions.jsonl")
    return metrics, rows


def test_diagnostics_agree_with_the_logged_completions(tmp_path, clean_env, one_thread):
    metrics, rows = _run(tmp_path / "lr")
    for m in metrics:
        step = [r for r in rows if r["step"] == m["step"]]
        assert len(step) == 16  # batch 4 x G 4, every one logged (no dynamic sampling: all trained)
        correct = sum(r["reward/vowels"] >= THRESHOLD for r in step) / len(step)
        # Counts over 16 rows are exact; advantage/abs_mean is the float64 sum of the same fp32 |A_i| the completions
        # log (exact in float64), summed here in another order: float64 roundings only (~1e-16 relative).
        # greedy_accuracy x 4 is a count over 4 prompts. Bound: approx's default 1e-6 relative.
        assert m["diagnostics/sampled_accuracy"] == pytest.approx(correct)
        assert m["advantage/abs_mean"] == pytest.approx(sum(abs(r["advantage"]) for r in step) / len(step))
        assert 0.0 <= m["diagnostics/greedy_accuracy"] <= 1.0
        assert (m["diagnostics/greedy_accuracy"] * 4) == pytest.approx(round(m["diagnostics/greedy_accuracy"] * 4))
        assert m["grad_norm"] > 0 and m["diagnostics/kl_step"] > 0  # the update moved the policy
    # The random model scores 0 on format and correctness: zero advantages, no gradient, no weight decay, so
    # the policy after each step is the policy before it and the KL is exactly 0.
    frozen, _ = _run(tmp_path / "still", vowel_reward=False, **{"optimizer.weight_decay": 0.0})
    assert [m["grad_norm"] for m in frozen] == [0.0, 0.0]
    assert [m["diagnostics/kl_step"] for m in frozen] == [0.0, 0.0]
    assert [m["diagnostics/sampled_accuracy"] for m in frozen] == [0.0, 0.0]


def test_a_correctness_reward_that_does_not_exist_fails_before_any_model(tmp_path, clean_env):
    from grpo_full_finetune_distributed import GRPOFullFinetuneRecipeDistributed

    cfg = OmegaConf.load(write_config(tmp_path, step_diagnostics=True, eval_reward="nope"))
    recipe = GRPOFullFinetuneRecipeDistributed(cfg)
    with pytest.raises(ValueError, match="eval_reward='nope' names no reward component"):
        recipe.setup(cfg)
    assert not hasattr(recipe, "model")
