"""Rewards: answer parsing and extraction, the format reward, RewardSet and build_reward_set."""

import logging
import math
import time
from fractions import Fraction

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_grpo.rewards import (
    FormatReward,
    MathAnswerReward,
    Reward,
    RewardBatch,
    RewardOutput,
    RewardSet,
    answers_match,
    build_reward_set,
    extract_answer,
    follows_format,
    parse_number,
)


def make_batch(completions, answers=None):
    n = len(completions)
    answers = answers if answers is not None else ["42"] * n
    return RewardBatch(
        prompts=["What is 6 x 7? <think>"] * n,
        completions=list(completions),
        completion_ids=[[1, 2, 3]] * n,
        fields=[{"answer": a} for a in answers],
    )


# ---------------------------------------------------------------- numbers


@pytest.mark.parametrize(
    "text, value",
    [
        ("1000", Fraction(1000)),
        ("1,000", Fraction(1000)),
        ("1000.0", Fraction(1000)),
        ("$1000", Fraction(1000)),
        ("\\$1,000", Fraction(1000)),
        (" 1000 ", Fraction(1000)),
        ("1000.", Fraction(1000)),
        ("-3", Fraction(-3)),
        ("+3", Fraction(3)),
        ("3/4", Fraction(3, 4)),
        ("0.75", Fraction(3, 4)),
        ("-3/4", Fraction(-3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{1}{3}", Fraction(1, 3)),
        ("50%", Fraction(50)),
        ("50\\%", Fraction(50)),
        (".5", Fraction(1, 2)),
        ("1.5e3", Fraction(1500)),
        ("1,234,567.25", Fraction(123456725, 100)),
        ("\\text{42}", Fraction(42)),
        ("٤٢", Fraction(42)),  # Arabic-Indic digits are read as digits
        ("４２", Fraction(42)),  # full-width digits too
        ("\u22123", Fraction(-3)),  # U+2212 MINUS SIGN
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text",
    ["", "  ", "abc", "42 apples", "1,5", "1,00", "3/0", "-", ".", "1e400", "²", "1+1", "1" * 5000, "9" * 201],
)
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_decimals_are_exact_not_float():
    # 0.1 + 0.2 != 0.3 in floats; exactly, 0.30000000000000004 != 0.3 either (no tolerance).
    assert parse_number("0.1") + parse_number("0.2") == parse_number("0.3")
    assert not answers_match("0.30000000000000004", "0.3")
    assert not answers_match("1000.0000001", "1000")


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("1,000", "1000"),
        ("1000.0", "1000"),
        ("$1000", "1000"),
        (" 1000 ", "1000"),
        ("1000.", "1,000"),
        ("-3", "-3.0"),
        ("3/4", "0.75"),
        ("50%", "50"),
        ("٤٢", "42"),
        ("  Paris ", "paris"),  # not numbers: normalised strings
        ("x  =\n2", "X = 2"),
    ],
)
def test_answers_match(pred, gold):
    assert answers_match(pred, gold)


@pytest.mark.parametrize("pred, gold", [("41", "42"), ("-3", "3"), ("0.5", "50%"), ("42 apples", "42"), ("", "42")])
def test_answers_differ(pred, gold):
    assert not answers_match(pred, gold)


# ---------------------------------------------------------------- extraction


def test_extract_answer_tag_takes_last_block():
    assert extract_answer("<answer>1</answer> no wait <answer> 2 </answer>", "answer_tag") == " 2 "
    assert extract_answer("<answer>unclosed", "answer_tag") is None
    assert extract_answer("no tags", "answer_tag") is None


def test_extract_boxed_balances_braces():
    assert extract_answer("so \\boxed{1} or rather \\boxed{\\frac{3}{4}}.", "boxed") == "\\frac{3}{4}"
    assert extract_answer("\\boxed{5} then \\boxed{unclosed", "boxed") == "5"
    assert extract_answer("} \\boxed{ {a} b }", "boxed") == " {a} b "
    assert extract_answer("nothing boxed", "boxed") is None


def test_extract_last_number():
    assert extract_answer("3 apples and 4 pears make 7.", "last_number") == "7"
    assert extract_answer("It costs $1,250.50 in total", "last_number") == "1,250.50"
    assert extract_answer("x = -3", "last_number") == "-3"
    assert extract_answer("5-3", "last_number") == "3"  # a subtraction, not -3
    assert extract_answer("half is 1/2", "last_number") == "1/2"
    assert extract_answer("no digits here", "last_number") is None


def test_extract_unknown_mode():
    with pytest.raises(ValueError, match="answer_tag"):
        extract_answer("x", "first_number")
    with pytest.raises(ValueError, match="boxed"):
        MathAnswerReward(extract="first_number")


# ---------------------------------------------------------------- MathAnswerReward


def test_math_reward_answer_tag():
    batch = make_batch(
        [
            "6 x 7 = 42 </think> <answer> 42 </answer>",  # 1
            "</think><answer>42.0</answer>",  # 1: numerically equal
            "</think><answer>41</answer>",  # 0: wrong
            "the answer is 42",  # 0: no answer tag
            "",  # 0: empty
            "</think><answer>  </answer>",  # 0: blank answer
            "</think><answer>1</answer> oops <answer>1,000</answer>",  # 1: last block, gold "1000"
        ],
        answers=["42", "42", "42", "42", "42", "42", "1000"],
    )
    assert MathAnswerReward()(batch) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_math_reward_boxed_and_last_number():
    batch = make_batch(["so \\boxed{\\frac{3}{4}}", "it is 0.75.", "\\boxed{3/4} and 7"], answers=["0.75"] * 3)
    assert MathAnswerReward(extract="boxed")(batch) == [1.0, 0.0, 1.0]
    assert MathAnswerReward(extract="last_number")(batch) == [0.0, 1.0, 0.0]


def test_math_reward_missing_gold_raises_keyerror():
    batch = RewardBatch(["p"], ["<answer>1</answer>"], [[1]], [{"question": "q"}])
    with pytest.raises(KeyError, match="answer"):
        MathAnswerReward()(batch)


def test_hostile_inputs_never_raise_and_stay_fast():
    huge_number = "7" * 5000  # > 4300 digits: int() would raise; parse_number must give up first
    completions = [
        "x" * 100_000,
        "1" * 100_000,
        ("<answer>" + "9" * 50_000 + "</answer>") * 2,
        "</think><answer>" + huge_number + "</answer>",
        "\\boxed{" * 20_000,
        "{" * 50_000 + "}" * 50_000,
        "1,2" * 30_000,
        "<answer>٤٢</answer>",
        "</think><answer>" + "</answer>" * 1000,
        "\x00\ud800<answer>\u200b</answer>",
        "<answer>1e99999999</answer>",
    ]
    answers = ["42"] * len(completions)
    answers[3] = huge_number  # same digits: equal as normalised strings
    batch = make_batch(completions, answers)
    start = time.perf_counter()
    for mode in ("answer_tag", "boxed", "last_number"):
        scores = MathAnswerReward(extract=mode)(batch)
        assert len(scores) == len(completions)
        assert all(s in (0.0, 1.0) for s in scores)
    for strict in (False, True):
        assert len(FormatReward(strict=strict)(batch)) == len(completions)
    assert MathAnswerReward()(batch)[3] == 1.0
    assert MathAnswerReward()(batch)[7] == 1.0  # "٤٢" == 42
    # Linear-time parsing: a generous bound that a quadratic scan of 100k characters would not meet.
    assert time.perf_counter() - start < 10.0


# ---------------------------------------------------------------- FormatReward


@pytest.mark.parametrize(
    "text, non_strict, strict",
    [
        ("Reasoning.\n</think>\n<answer>\n42\n</answer>", 1.0, 1.0),
        ("Reasoning.</think>\n<answer>\n42\n</answer>\n<|im_end|>", 1.0, 1.0),  # trailing eos allowed
        ("Reasoning. </think>  <answer> 42 </answer>", 1.0, 0.0),  # spaces instead of newlines
        ("Reasoning.\n</think>\n\n<answer>\n42\n</answer>", 1.0, 0.0),  # blank line between
        ("Reasoning.\n</think>\n<answer>\n42\n</answer> and some more text", 1.0, 0.0),  # text after answer
        ("</think><answer>42</answer>", 1.0, 0.0),  # empty reasoning
        ("Reasoning <answer>42</answer>", 0.0, 0.0),  # missing </think>
        ("The answer is 42.", 0.0, 0.0),  # no tags
        ("", 0.0, 0.0),  # empty
        ("Reasoning </think> text <answer>42</answer>", 0.0, 0.0),  # text between think and answer
        ("Reasoning </think> <answer> </answer>", 0.0, 0.0),  # blank answer
        ("R </think> <answer>1</answer> <answer>2</answer>", 0.0, 0.0),  # repeated answer blocks
        ("R </think> <answer><answer>1</answer></answer>", 0.0, 0.0),  # nested answer tags
        ("<think> R </think> <answer>1</answer>", 0.0, 0.0),  # nested think (prompt already opened one)
        ("R </think> </think> <answer>1</answer>", 0.0, 0.0),  # repeated </think>
        ("R <answer>1</answer> </think>", 0.0, 0.0),  # wrong order
        ("R </think> </answer>1<answer>", 0.0, 0.0),  # answer tags reversed
    ],
)
def test_format_reward_think_in_prompt(text, non_strict, strict):
    batch = make_batch([text])
    assert FormatReward()(batch) == [non_strict]
    assert FormatReward(strict=True)(batch) == [strict]


@pytest.mark.parametrize(
    "text, non_strict, strict",
    [
        ("<think>\nR\n</think>\n<answer>\n42\n</answer>", 1.0, 1.0),
        ("  <think> R </think> <answer> 42 </answer>", 1.0, 0.0),  # leading whitespace, spaces
        ("R </think> <answer>42</answer>", 0.0, 0.0),  # must open <think> itself
        ("x <think> R </think> <answer>42</answer>", 0.0, 0.0),  # text before <think>
        ("</think> <think> R <answer>42</answer>", 0.0, 0.0),  # closed before opened
    ],
)
def test_format_reward_think_in_completion(text, non_strict, strict):
    batch = make_batch([text])
    assert FormatReward(think_in_prompt=False)(batch) == [non_strict]
    assert FormatReward(strict=True, think_in_prompt=False)(batch) == [strict]


def test_follows_format_custom_eos():
    text = "R\n</think>\n<answer>\n42\n</answer><eos><eos>\n"
    assert not follows_format(text, strict=True)
    assert follows_format(text, strict=True, eos_text=["<eos>"])


# ---------------------------------------------------------------- RewardSet


class ConstReward(Reward):
    def __init__(self, value):
        self.value = value

    def __call__(self, batch):
        return [self.value] * len(batch.completions)


class Boom(Reward):
    def __call__(self, batch):
        raise RuntimeError("sandbox died")


def length_reward(batch):
    return [float(len(c)) for c in batch.completions]


def test_reward_names():
    assert MathAnswerReward.name == "math_answer_reward"
    assert FormatReward().name == "format_reward"
    assert ConstReward(1.0).name == "const_reward"
    rs = RewardSet([MathAnswerReward(), length_reward], weights=[1.0, 1.0])
    assert rs.names == ["math_answer_reward", "length_reward"]


def test_reward_set_weighted_sum():
    # completions:          correct+formatted    formatted, wrong     neither
    # correctness (w 1.0):  1                    0                    0
    # format      (w 0.5):  1                    1                    0
    # length      (w 0.01): 34                   34                   2
    #   ("6 x 7 " 6 + "</think>" 8 + " " 1 + "<answer>" 8 + "42" 2 + "</answer>" 9 = 34 characters)
    # total = 1 + 0.5 + 0.34 = 1.84;  0 + 0.5 + 0.34 = 0.84;  0 + 0 + 0.02 = 0.02
    batch = make_batch(
        ["6 x 7 </think> <answer>42</answer>", "6 x 7 </think> <answer>41</answer>", "hm"]
    )
    rs = RewardSet(
        [MathAnswerReward(), FormatReward(), length_reward], weights=[1.0, 0.5, 0.01], names=["correct", "fmt", "len"]
    )
    out = rs(batch)
    assert isinstance(out, RewardOutput)
    assert out.total.dtype == torch.float32
    torch.testing.assert_close(out.total, torch.tensor([1.84, 0.84, 0.02]))
    assert out.per_component["correct"].tolist() == [1.0, 0.0, 0.0]
    assert out.per_component["fmt"].tolist() == [1.0, 1.0, 0.0]
    assert out.per_component["len"].tolist() == [34.0, 34.0, 2.0]
    assert out.errors == {"correct": 0, "fmt": 0, "len": 0}


def test_reward_set_fallback_on_exception(caplog):
    # Boom raises: all 3 samples get fallback -1, counted; total = 2 * 1 + 0.5 * (-1) = 1.5
    rs = RewardSet([ConstReward(1.0), Boom()], weights=[2.0, 0.5], fallback=-1.0)
    with caplog.at_level(logging.WARNING):
        out = rs(make_batch(["a", "b", "c"]))
    assert out.errors == {"const_reward": 0, "boom": 3}
    assert out.per_component["boom"].tolist() == [-1.0, -1.0, -1.0]
    assert out.total.tolist() == [1.5, 1.5, 1.5]
    assert "boom" in caplog.text and "sandbox died" in caplog.text


@pytest.mark.parametrize(
    "bad, match",
    [
        ([1.0], "returned 1 scores for a batch of 2"),
        ([1.0, float("nan")], "non-finite"),
        ([1.0, float("inf")], "non-finite"),
        ([1.0, "1.0"], "non-number"),
        ([1.0, None], "non-number"),
        (1.0, "expected a list"),
        ("ab", "expected a list"),
    ],
)
def test_reward_set_rejects_malformed_output(bad, match):
    rs = RewardSet([lambda batch: bad], weights=[1.0], names=["buggy"])
    with pytest.raises(ValueError, match=match) as e:
        rs(make_batch(["a", "b"]))
    assert "'buggy'" in str(e.value)


def test_reward_set_accepts_tensors_arrays_and_ints():
    np = pytest.importorskip("numpy")
    rs = RewardSet(
        [lambda b: torch.tensor([1.0, 0.0]), lambda b: np.array([0.5, 0.25]), lambda b: [1, True]],
        weights=[1.0, 1.0, 1.0],
        names=["t", "np", "i"],
    )
    # [1 + 0.5 + 1, 0 + 0.25 + 1] = [2.5, 1.25]
    assert rs(make_batch(["a", "b"])).total.tolist() == [2.5, 1.25]


def test_reward_set_validation():
    with pytest.raises(ValueError, match="unique"):
        RewardSet([FormatReward(), FormatReward(strict=True)], weights=[1.0, 1.0])
    with pytest.raises(ValueError, match="weights"):
        RewardSet([FormatReward()], weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="at least one"):
        RewardSet([], weights=[])
    with pytest.raises(ValueError, match="finite"):
        RewardSet([FormatReward()], weights=[math.nan])
    with pytest.raises(ValueError, match="same length"):
        RewardSet([FormatReward()], weights=[1.0])(RewardBatch(["p"], ["a", "b"], [[1], [2]], [{}, {}]))


# ---------------------------------------------------------------- build_reward_set


def test_build_reward_set_from_dicts_and_yaml():
    specs = [
        {"_component_": "torchtune_grpo.rewards.MathAnswerReward", "weight": 1.0, "name": "correctness",
         "extract": "boxed"},
        {"_component_": "torchtune_grpo.rewards.FormatReward", "weight": 0.25},
    ]
    rs = build_reward_set(specs)
    assert rs.names == ["correctness", "format_reward"]
    assert rs.weights == [1.0, 0.25]
    assert rs.rewards[0].extract == "boxed"
    assert specs[0]["weight"] == 1.0  # the caller's specs are not mutated

    cfg = OmegaConf.create(
        """
        budget: 0.5
        rewards:
          - _component_: torchtune_grpo.rewards.FormatReward
            strict: true
            weight: ${budget}
        """
    )
    rs = build_reward_set(cfg.rewards, fallback=-1.0)
    assert rs.names == ["format_reward"] and rs.weights == [0.5] and rs.fallback == -1.0
    assert rs.rewards[0].strict is True
    assert "weight" in cfg.rewards[0]  # config untouched
    out = rs(make_batch(["R\n</think>\n<answer>\n42\n</answer>"]))
    assert out.total.tolist() == [0.5]


def test_build_reward_set_errors():
    with pytest.raises(ValueError, match="no rewards"):
        build_reward_set([])
    with pytest.raises(ValueError, match="no rewards"):
        build_reward_set(None)
    with pytest.raises(ValueError, match="_component_"):
        build_reward_set([{"weight": 1.0}])
