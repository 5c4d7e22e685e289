"""Custom Python rewards: loading from dotted paths and files, the column signature, async, YAML, and the
worked example of docs/rewards.md (docs/examples/custom_reward.py)."""

import asyncio
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from torchtune_grpo.rewards import PythonReward, RewardBatch, build_reward_set, load_function, python_reward

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "custom_reward.py"


def make_batch(completions, answers=None, **columns):
    n = len(completions)
    answers = answers if answers is not None else ["42"] * n
    fields = [{"answer": a, **{k: v[i] for k, v in columns.items()}} for i, a in enumerate(answers)]
    return RewardBatch(prompts=[f"p{i}" for i in range(n)], completions=list(completions),
                       completion_ids=[[i] for i in range(n)], fields=fields)


# Functions loaded by dotted path in the tests below.


def only_answer(completions, answer):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


SEEN = {}


def everything(completions, **columns):
    SEEN.clear()
    SEEN.update(columns)
    return [0.0] * len(completions)


def with_threshold(completions, answer, threshold=0.5):
    return [threshold] * len(completions)


async def async_len(completions):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def sleepy(completions):
    if "slow" in completions:
        time.sleep(3)
    return [1.0] * len(completions)


def needs_solution(completions, solution):
    return [1.0] * len(completions)


NOT_CALLABLE = 3


# ---------------------------------------------------------------- loading


def test_load_function_forms(tmp_path, monkeypatch):
    assert load_function("tests.test_rewards_python.only_answer") is only_answer
    assert load_function("tests.test_rewards_python:only_answer") is only_answer
    assert load_function("torchtune_grpo.rewards.answers_match").__name__ == "answers_match"

    path = tmp_path / "my_rewards.py"
    path.write_text("def shout(completions):\n    return [float(c.isupper()) for c in completions]\n")
    fn = load_function(f"{path}:shout")
    assert fn(["AB", "ab"]) == [1.0, 0.0]
    assert load_function(f"{path}:shout") is fn  # the file is loaded once
    monkeypatch.chdir(tmp_path)
    assert load_function("my_rewards.py:shout") is fn  # relative to the working directory


@pytest.mark.parametrize(
    "spec, match",
    [
        ("no_such_module_xyz.fn", "cannot import reward function"),
        ("tests.test_rewards_python.missing", "has no attribute 'missing'"),
        ("tests.test_rewards_python:missing", "has no attribute 'missing'"),
        ("tests.test_rewards_python.NOT_CALLABLE", "not a callable"),
        ("/no/such/file.py:fn", "reward file not found"),
        ("rewards.py", "give the function name"),
        ("", "non-empty"),
    ],
)
def test_load_function_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        load_function(spec)


def test_function_must_take_completions():
    with pytest.raises(ValueError, match="completions as its first argument"):
        PythonReward(lambda: [1.0])


# ---------------------------------------------------------------- the signature


def test_columns_passed_by_name():
    batch = make_batch(["42", "7"], answers=["42", "42"], level=["easy", "hard"])
    assert PythonReward(only_answer)(batch) == [1.0, 0.0]  # receives only what it declares
    PythonReward(everything)(batch)  # **columns receives them all, as lists aligned with completions
    assert SEEN["answer"] == ["42", "42"]
    assert SEEN["level"] == ["easy", "hard"]
    assert SEEN["prompts"] == ["p0", "p1"]
    assert SEEN["completion_ids"] == [[0], [1]]


def test_function_kwargs_and_name():
    reward = python_reward("tests.test_rewards_python.with_threshold", function_kwargs={"threshold": 0.25})
    assert reward.name == "with_threshold"
    assert reward(make_batch(["a"])) == [0.25]
    assert python_reward(with_threshold, name="thr").name == "thr"


def test_async_function():
    reward = python_reward("tests.test_rewards_python.async_len")
    assert reward.is_async
    assert reward(make_batch(["abc", ""])) == [3.0, 0.0]


def test_from_yaml_with_timeout_and_fallback():
    cfg = OmegaConf.create(
        """
        reward_functions:
          - _component_: torchtune_grpo.rewards.python_reward
            function: tests.test_rewards_python.sleepy
            name: guarded
            weight: 2.0
            timeout: 0.3
            fallback: -1.0
          - _component_: torchtune_grpo.rewards.python_reward
            function: tests.test_rewards_python.with_threshold
            function_kwargs: {threshold: 0.1}
        """
    )
    rs = build_reward_set(cfg.reward_functions)
    assert rs.names == ["guarded", "with_threshold"]
    start = time.perf_counter()
    out = rs(make_batch(["slow", "fast"]))
    assert time.perf_counter() - start < 2.0
    # guarded: "slow" times out -> -1 (x2 weight); "fast" 1.0 (x2). with_threshold: 0.1 each.
    assert out.per_component["guarded"].tolist() == [-1.0, 1.0]
    assert out.errors == {"guarded": 1, "with_threshold": 0}
    # Weighted sum of exact small values (-1, 1, 0.1 x weights 2 and 1) in fp32: 0.1 is rounded once (1.5e-9 relative)
    # and each of 2 products/adds rounds once (6e-8 relative). Bound: approx's default 1e-6 relative.
    assert out.total.tolist() == pytest.approx([-1.9, 2.1])


def test_missing_column_is_a_counted_error():
    # The function needs a column the dataset lacks: TypeError -> the batch falls back, counted.
    out = build_reward_set([{"_component_": "torchtune_grpo.rewards.python_reward",
                             "function": "tests.test_rewards_python.needs_solution"}])(make_batch(["a", "b"]))
    assert out.errors == {"needs_solution": 2}


# ---------------------------------------------------------------- docs/rewards.md worked example


def test_docs_example_numbers():
    fn = load_function(f"{EXAMPLE}:concise_correct")
    completions = [
        "x </think> <answer>42</answer>",
        "a b c d e f </think> <answer>42</answer>",
        "a b c d </think> <answer>42</answer>",
        "x </think> <answer>41</answer>",
        "",
    ]
    assert fn(completions, ["42"] * 5, max_words=4) == [1.0, 0.5, 0.75, 0.0, 0.0]


def test_docs_example_through_yaml(monkeypatch):
    monkeypatch.chdir(REPO)  # the doc's YAML uses a path relative to the repository root
    cfg = OmegaConf.create(
        """
        reward_functions:
          - _component_: torchtune_grpo.rewards.python_reward
            function: docs/examples/custom_reward.py:concise_correct
            function_kwargs: {max_words: 4}
            weight: 1.0
            timeout: 2.0
            fallback: 0.0
          - _component_: torchtune_grpo.rewards.python_reward
            function: docs/examples/custom_reward.py:polite
            weight: 0.1
        """
    )
    rs = build_reward_set(cfg.reward_functions)
    out = rs(make_batch(["x </think> <answer>42</answer> thanks", "a b c d </think> <answer>42</answer>"]))
    # concise_correct: 4 words -> 1.0; 6 words -> 0.75.  polite: "thanks" -> 1.0 (x 0.1).
    assert out.per_component["concise_correct"].tolist() == [1.0, 0.75]
    assert out.per_component["polite"].tolist() == [1.0, 0.0]
    # As above: fp32 0.1 and one or two roundings (~1e-7 relative). Bound: approx's default 1e-6 relative.
    assert out.total.tolist() == pytest.approx([1.1, 0.75])


def test_docs_testing_snippet(monkeypatch):
    # The "Testing a reward" snippet of docs/rewards.md, verbatim in substance.
    monkeypatch.chdir(REPO)

    def batch(completions, answer="42"):
        n = len(completions)
        return RewardBatch(["q"] * n, completions, [[0]] * n, [{"answer": answer}] * n)

    rs = build_reward_set([{
        "_component_": "torchtune_grpo.rewards.python_reward",
        "function": "docs/examples/custom_reward.py:concise_correct",
        "function_kwargs": {"max_words": 4},
    }])
    out = rs(batch(["x </think> <answer>42</answer>", "a b c d </think> <answer>42</answer>",
                    "", "<answer><answer>42</answer></answer>", "9" * 100_000]))
    assert out.per_component["concise_correct"].tolist() == [1.0, 0.75, 0.0, 0.0, 0.0]
    assert out.errors == {"concise_correct": 0}
