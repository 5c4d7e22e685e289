"""Process rewards through the recipe: a step-level reward and the process-supervised advantage in YAML, the
KL penalty in the reward, the algorithm card, completions.jsonl; the demo's step checker and config.
(1 vs 2 processes, micro-batches and packed rows with token-level advantages:
tests/test_algorithms_recipe.py::test_every_variant_is_independent_of_micro_batches_and_processes.)"""

import json
import math

import pytest

from omegaconf import OmegaConf
from torchtune import config as tt_config

from tests.conftest import REPO
from tests.recipe_utils import read_jsonl, recipe_in_process, write_config
from torchtune_grpo.rewards import build_reward_set, column_addition_step
from torchtune_grpo.rollouts.process_advantages import ProcessSupervisedAdvantage

STEP_REWARD = {"_component_": "torchtune_grpo.rewards.PythonStepReward", "function": "tests._rewards.vowel_step",
               "steps": {"function": "tests._rewards.every_third_token"}, "aggregate": "mean", "weight": 0.5}


def test_process_advantages_in_the_recipe(tmp_path, clean_env, one_thread):
    cfg = OmegaConf.load(write_config(
        tmp_path, max_steps=2, save_every_n_steps=None, log_completions=4, kl_coef=0.05, kl_placement="reward",
        advantage={"_component_": "torchtune_grpo.rollouts.process_advantages.ProcessSupervisedAdvantage",
                   "outcome_weight": 1.0, "process_weight": 1.0},
    ))
    cfg.reward_functions.append(STEP_REWARD)
    seen = []
    with recipe_in_process(cfg) as recipe:
        before = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
        build = recipe.step.build_experience

        def capture(policy, trained):
            built = build(policy, trained)
            seen.append((trained, built))
            return built

        recipe.step.build_experience = capture
        recipe.train()
        moved = max((v - before[k]).abs().max().item() for k, v in recipe.model.state_dict().items())
    out = tmp_path / "out"
    trained, built = seen[-1]
    exp = built.experience
    assert exp.advantages.shape == exp.mask.shape  # [N, T]: one advantage per token
    # Within a row the advantage changes at the step ends (every third token), so it is not one per sequence.
    varies = [(exp.advantages[i][exp.mask[i]].unique().numel() > 1) for i in range(len(exp))]
    # (The KL penalty's part in the outcome is checked by hand in tests/test_process_advantages.py: two steps of
    # the near-uniform tiny model leave it below fp32 resolution here.)
    assert any(varies) and moved > 0
    assert trained.step_component == "vowel_step" and len(trained.step_scores) == len(trained.response_ids)
    for ids, ends in zip(trained.response_ids, trained.step_ends):
        assert ends[-1] == len(ids) - 1 and ends[:-1] == list(range(2, len(ids) - 1, 3))
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["loss"]) and 0 <= m["reward/vowel_step/mean"] <= 1 for m in metrics)
    record = read_jsonl(out / "completions.jsonl")[0]
    assert len(record["step_scores"]) == len(record["step_ends"]) > 0
    card = (out / "algorithm_card.md").read_text()
    assert "end(i,j) >= t" in card and "DeepSeekMath 4.1.3" in card and "step-level" in card and "A_i,t" in card


def test_the_column_checker_tells_a_lucky_answer_from_a_sound_derivation():
    def steps(text):
        parts = [s.strip() for s in text.split(",")]
        return [column_addition_step(s, i, parts) for i, s in enumerate(parts)]

    # 58 + 67: the units carry 1 into the tens.
    assert steps("8+7=15,5+6+1=12 </think> <answer> 125 </answer>") == [1.0, 1.0]  # sound
    assert steps("8+7=15,5+6+0=11 </think> <answer> 125 </answer>") == [1.0, 0.0]  # lucky: carry dropped
    assert steps("8+7=15,5+6+0=11 </think> <answer> 115 </answer>") == [1.0, 0.0]  # careless
    assert steps("8+7=15,5+6+1=12 </think> <answer> 115 </answer>") == [1.0, 0.0]  # answer not the columns'
    assert steps("8+7=14,5+6+1=12 </think> <answer> 125 </answer>") == [0.0, 0.0]  # wrong sum, wrong carry
    assert steps("12 </think> <answer> 12 </answer>") == [0.0]


def test_demo_config_builds_both_arms():
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / "demo_process_grpo.yaml")
    rewards = build_reward_set(cfg.reward_functions)
    assert rewards.step_component == "column_steps" and rewards.weights == [0.1, 1.0, 0.0]
    advantage = tt_config.instantiate(cfg.advantage)
    assert isinstance(advantage, ProcessSupervisedAdvantage)
    assert (advantage.outcome_weight, advantage.process_weight) == (1.0, 1.0)
    # Everything else is demo_grpo.yaml's: the two demos train the same model on the same task.
    base = OmegaConf.load(REPO / "configs" / "tiny" / "demo_grpo.yaml")
    for key in ("model", "tokenizer", "dataset", "loss", "optimizer", "batch_size", "group_size"):
        assert cfg[key] == base[key], key


def test_plot_compare_draws_every_seed_and_names_a_missing_metric(tmp_path):
    from torchtune_grpo.metrics.plotting import plot_compare

    for name, values in (("a0", [0.1, 0.2]), ("a1", [0.3, 0.5]), ("b0", [0.0, 0.1])):
        (tmp_path / name).mkdir()
        rows = [{"step": k + 1, "reward/x/mean": v} for k, v in enumerate(values)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = plot_compare({"a": [tmp_path / "a0", tmp_path / "a1"], "b": [tmp_path / "b0"]},
                       [("reward/x/mean", "x")], tmp_path / "plot.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="the runs of 'a' logged no 'reward/y/mean'"):
        plot_compare({"a": [tmp_path / "a0"]}, [("reward/y/mean", "y")], tmp_path / "other.png")
