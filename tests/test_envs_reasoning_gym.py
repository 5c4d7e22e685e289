"""reasoning-gym adapter: rows, splits, the task's own scorer, per-task metrics, and a few CPU training steps.

Needs the reasoning-gym extra (tests/extras.py: CI installs it; a missing extra fails, never skips).
"""

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests._env_runs import check_resume_equals_uninterrupted, check_two_processes
from tests.conftest import REPO
from tests.extras import extra_pythonpath, use_extra
from tests.recipe_utils import read_jsonl, run_tune
from torchtune_grpo.rewards import RewardBatch, RewardSample, build_reward_set

from torchtune_grpo.envs import ReasoningGymReward, reasoning_gym_dataset, reasoning_gym_rows  # the library on first use


@pytest.fixture(scope="module", autouse=True)
def _reasoning_gym_extra():
    """The reasoning-gym extra, imported when this file's tests run, not when pytest collects them: each xdist
    worker collects every file, and importing reasoning-gym's task modules takes ~0.9 s."""
    use_extra("reasoning-gym")

CONFIG = REPO / "configs" / "tiny" / "reasoning_gym_cpu.yaml"
MIX = [
    {"name": "chain_sum", "weight": 3, "label": "easy", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}},
    {"name": "chain_sum", "weight": 1, "label": "hard", "config": {"min_terms": 4, "max_terms": 5, "max_digits": 2}},
    "basic_arithmetic",
]


def test_rows_follow_the_mix_and_are_reproducible():
    rows, _ = reasoning_gym_rows(MIX, num_samples=400, seed=3, validation_size=0)
    again, _ = reasoning_gym_rows(MIX, num_samples=400, seed=3, validation_size=0)
    other, _ = reasoning_gym_rows(MIX, num_samples=400, seed=4, validation_size=0)
    assert [r["question"] for r in rows] == [r["question"] for r in again]
    assert [r["question"] for r in rows] != [r["question"] for r in other]
    share = {g: sum(r["metric_group"] == g for r in rows) / len(rows) for g in ("easy", "hard", "basic_arithmetic")}
    # weights 3:1:1 -> 0.6, 0.2, 0.2; 400 draws: a binomial sd of ~0.025, so 0.08 is > 3 sd
    assert abs(share["easy"] - 0.6) < 0.08 and abs(share["hard"] - 0.2) < 0.08, share
    # each entry's difficulty settings reach the generator: "easy" has 2 one-digit terms, "hard" 4-5 terms
    easy = [r for r in rows if r["metric_group"] == "easy"]
    hard = [r for r in rows if r["metric_group"] == "hard"]
    assert all(r["rg_entry"]["metadata"]["num_terms"] == 2 for r in easy)
    assert all(r["rg_entry"]["metadata"]["num_terms"] >= 4 for r in hard)
    assert all(r["metric_groups"] == ["easy", "hard", "basic_arithmetic"] for r in rows)


def test_validation_split_is_disjoint_from_train():
    # Two one-digit terms: only ~200 distinct questions, so independent draws would certainly overlap.
    tasks = [{"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}]
    held_out, _ = reasoning_gym_rows(tasks, seed=0, split="validation", validation_size=50)
    train, dropped = reasoning_gym_rows(tasks, num_samples=300, seed=0, validation_size=50)
    assert len(held_out) == 50
    assert dropped > 0 and len(train) == 300 - dropped
    assert not {r["question"] for r in held_out} & {r["question"] for r in train}


def test_dataset_formats_prompts(tokenizer):
    ds = reasoning_gym_dataset(tokenizer, "chain_sum", num_samples=8, validation_size=4, max_prompt_length=None)
    item = ds[0]
    assert item["prompt"].endswith("Assistant: <think>") and item["question"] in item["prompt"]
    assert tokenizer.decode(item["tokens"]) == item["prompt"]
    assert item["answer"] == item["rg_entry"]["answer"]


def test_reward_is_the_tasks_own_scorer():
    import reasoning_gym

    rows, _ = reasoning_gym_rows(MIX, num_samples=60, seed=1, validation_size=0)
    reward = ReasoningGymReward()
    completions, expected = [], []
    for i, row in enumerate(rows):
        answer = row["answer"] if i % 3 else str(int(row["answer"]) + 1)  # every third one is wrong
        completions.append(f"<think> work </think> <answer>{answer}</answer>")
        scorer = reasoning_gym.create_dataset(row["rg_source"], **row["rg_config"])
        expected.append(scorer.score_answer(answer, row["rg_entry"]))
    batch = RewardBatch([""] * len(rows), completions, [[]] * len(rows), rows)
    assert reward(batch) == expected
    # A float64 sum of scores 1.0 and 0.0: exact; approx's default.
    assert sum(expected) == pytest.approx(len(rows) - 20)  # the right ones score 1, the wrong ones 0
    # no <answer> block: no answer; extract=None scores the whole completion, last_number the prose's last number
    assert reward.score_one(RewardSample("", rows[1]["answer"], [], rows[1])) == 0.0
    assert ReasoningGymReward(extract=None).score_one(RewardSample("", f" {rows[1]['answer']}\n", [], rows[1])) == 1.0
    prose = f"The final answer is {rows[1]['answer']}."
    assert ReasoningGymReward(extract="last_number").score_one(RewardSample("", prose, [], rows[1])) == 1.0
    with pytest.raises(ValueError, match="extract must be one of"):
        ReasoningGymReward(extract="first_word")


def test_reward_on_a_foreign_row_fails_that_sample_only():
    rewards = build_reward_set([{"_component_": "torchtune_grpo.envs.ReasoningGymReward", "weight": 1.0}], fallback=-1.0)
    rows, _ = reasoning_gym_rows("chain_sum", num_samples=1, seed=0, validation_size=0)
    out = rewards(RewardBatch(["", ""], [f"<answer>{rows[0]['answer']}</answer>"] * 2, [[], []],
                              [rows[0], {"answer": "3"}]))
    assert out.total.tolist() == [1.0, -1.0] and out.errors == {"reasoning_gym": 1}


@pytest.mark.parametrize("tasks, message", [
    ([], "empty"),
    (["no_such_task"], "has no task 'no_such_task'"),
    ([{"name": "chain_sum", "wieght": 2}], "unknown keys"),
    (["chain_sum", "chain_sum"], "label 'chain_sum' is used twice"),
    ([{"name": "chain_sum", "weight": 0}], "every weight is 0"),
    ([{"name": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}], "chain_sum"),
])
def test_bad_task_mixes_are_refused_by_name(tasks, message):
    with pytest.raises(ValueError, match=message):
        reasoning_gym_rows(tasks, num_samples=4, validation_size=0)


@pytest.mark.parametrize("engine", ["vllm"])
def test_tiny_config_trains_with_per_task_metrics(tmp_path: Path, monkeypatch, engine: str):
    # The adapters are a dataset and a reward: any engine samples for them (vLLM: its own weights, synced).
    # The native engine's run of this config: test_resume_and_two_processes (its two-process `tune run`).
    extra_pythonpath(monkeypatch, "reasoning-gym")
    cfg = OmegaConf.load(CONFIG)
    cfg.output_dir = str(tmp_path / "out")
    cfg.max_steps, cfg.save_every_n_steps = 2, 2
    if engine == "vllm":
        cfg.generation = {
            "_component_": "torchtune_grpo.generation.VLLMGenerator", "model": "${checkpointer.checkpoint_dir}",
            "temperature": 1.0, "max_model_len": cfg.max_prompt_length + cfg.max_response_length,
            "kv_cache_memory_gib": 0.25,
        }
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path)
    run_tune(path, cwd=tmp_path)
    logs = tmp_path / "out" / "metrics.jsonl"
    rows = read_jsonl(logs)
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss"]) for r in steps)
    for r in steps:
        for label in ("sum2", "sum3", "basic_arithmetic"):
            assert f"reward_by_group/{label}/mean" in r and f"reward_by_group/{label}/reasoning_gym/mean" in r
        assert "reward/reasoning_gym/mean" in r
        if engine == "vllm":
            assert r["generation/sync_logprob_diff"] < 1e-3 and r["generation/logprob_mismatch"] < 1e-3, r
    evals = [r for r in rows if "eval/accuracy" in r]
    assert len(evals) >= 2  # step 0 and the end
    assert (tmp_path / "out" / "step_2").is_dir()


@pytest.mark.slow
def test_resume_and_two_processes(tmp_path: Path, monkeypatch):
    extra_pythonpath(monkeypatch, "reasoning-gym")
    cfg = OmegaConf.load(CONFIG)
    # The resume: the training data's order and rewards (no evaluation: the two-process run has it)
    check_resume_equals_uninterrupted(OmegaConf.merge(cfg, {"validation": None}), tmp_path)
    # The shipped config through `tune run` with the native engine: per-task metrics and the evaluation.
    steps = check_two_processes(cfg, tmp_path)
    for r in steps:
        for label in ("sum2", "sum3", "basic_arithmetic"):
            assert f"reward_by_group/{label}/mean" in r and f"reward_by_group/{label}/reasoning_gym/mean" in r
        assert "reward/reasoning_gym/mean" in r
    evals = [r for r in read_jsonl(tmp_path / "out2" / "metrics.jsonl") if "eval/accuracy" in r]
    assert len(evals) >= 2  # step 0 and the end
    assert (tmp_path / "out2" / "step_2").is_dir()
