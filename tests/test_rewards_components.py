"""Built-in components: math correctness (math-verify and the built-in fallback), exact match / contains,
format, and hostile completions."""

import sys
import time

import pytest

from torchtune_grpo.rewards import (
    ContainsReward,
    ExactMatchReward,
    FormatReward,
    MathAnswerReward,
    RewardBatch,
    build_reward_set,
    math_verify_available,
    math_verify_match,
)
from torchtune_grpo.rewards import _math


def make_batch(completions, answers=None, **extra):
    n = len(completions)
    answers = answers if answers is not None else ["42"] * n
    return RewardBatch(
        prompts=["q"] * n,
        completions=list(completions),
        completion_ids=[[1]] * n,
        fields=[{"answer": a, **extra} for a in answers],
    )


@pytest.fixture
def no_math_verify(monkeypatch):
    """Makes `import math_verify` fail, as when the optional extra is not installed."""
    monkeypatch.setitem(sys.modules, "math_verify", None)
    assert not math_verify_available()


needs_math_verify = pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed")


# ---------------------------------------------------------------- math: backends


def test_auto_backend_falls_back_to_builtin(no_math_verify):
    reward = MathAnswerReward(extract="boxed")
    assert reward.backend == "builtin"
    # Built-in: exact numbers (3/4 == 0.75) and normalised strings; no symbolic LaTeX.
    batch = make_batch(
        ["\\boxed{\\frac{3}{4}}", "\\boxed{0.75}", "\\boxed{\\frac{\\sqrt{2}}{2}}", "\\boxed{0.7}"],
        answers=["0.75", "3/4", "\\sqrt{2}/2", "0.75"],
    )
    assert reward(batch) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ImportError, match="torchtune-grpo\\[math\\]"):
        MathAnswerReward(backend="math_verify")
    with pytest.raises(ImportError):
        math_verify_match("1", "1")


def test_builtin_backend_is_forced_even_when_installed():
    assert MathAnswerReward(backend="builtin").backend == "builtin"
    with pytest.raises(ValueError, match="unknown backend"):
        MathAnswerReward(backend="sympy")


@needs_math_verify
def test_math_verify_backend_symbolic_equivalence():
    reward = MathAnswerReward(extract="boxed", backend="math_verify")
    assert reward.backend == "math_verify"
    assert MathAnswerReward().backend == "math_verify"  # auto picks it up when installed
    batch = make_batch(
        [
            "\\boxed{\\frac{\\sqrt{2}}{2}}",  # = sqrt(2)/2: only math-verify sees this
            "\\boxed{(1,2)}",  # interval (1, 2) written differently
            "\\boxed{0.75}",  # = 3/4, built-in already says so
            "\\boxed{\\pi}",  # pi != 3.14159
            "\\boxed{x^2}",  # != 2
            "\\boxed{٤٢}",  # math-verify cannot read Arabic-Indic digits; the built-in check can
            "no box at all 42",
        ],
        answers=["\\sqrt{2}/2", "(1, 2)", "\\frac{3}{4}", "3.14159", "2", "42", "42"],
    )
    assert reward(batch) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


@needs_math_verify
def test_math_verify_in_worker_threads():
    # Per-sample mode runs the reward in threads, where math-verify's signal-based timeouts cannot work:
    # they are switched off there and RewardSet's own timeout applies.
    rs = build_reward_set(
        [{"_component_": "torchtune_grpo.rewards.MathAnswerReward", "extract": "boxed", "timeout": 10,
          "concurrency": 2}]
    )
    out = rs(make_batch(["\\boxed{\\frac{\\sqrt{2}}{2}}", "\\boxed{1}"], answers=["\\sqrt{2}/2"] * 2))
    assert out.per_component["math_answer_reward"].tolist() == [1.0, 0.0]
    assert out.errors == {"math_answer_reward": 0}


@needs_math_verify
def test_math_verify_rejects_huge_answers_fast():
    start = time.perf_counter()
    assert not math_verify_match("9" * 5000, "9" * 5000)  # longer than MAX_MATH_VERIFY_CHARS: skipped
    assert time.perf_counter() - start < 1.0
    # The built-in comparison still sees equal strings.
    assert MathAnswerReward()(make_batch(["<answer>" + "9" * 5000 + "</answer>"], ["9" * 5000])) == [1.0]


@pytest.mark.parametrize("backend", ["builtin", "auto"])
def test_extraction_modes(backend):
    completions = [
        "</think><answer>42</answer>",
        "so the result is \\boxed{42}.",
        "6 times 7 gives 42",
        "<answer>41</answer> \\boxed{42}",
    ]
    batch = make_batch(completions)
    assert MathAnswerReward(extract="answer_tag", backend=backend)(batch) == [1.0, 0.0, 0.0, 0.0]
    assert MathAnswerReward(extract="boxed", backend=backend)(batch) == [0.0, 1.0, 0.0, 1.0]
    assert MathAnswerReward(extract="last_number", backend=backend)(batch) == [1.0, 1.0, 1.0, 1.0]


# ---------------------------------------------------------------- hostile output


HOSTILE = [
    "",  # empty completion
    "no tags, no numbers",
    "<answer>42",  # unclosed
    "</answer>42<answer>",  # reversed
    "<answer><answer>42</answer></answer>",  # nested
    "<answer>1</answer><answer>2</answer><answer>42</answer>",  # repeated: the last counts
    "<answer>" + "9" * 100_000 + "</answer>",  # huge number
    "<answer>1e999999999</answer>",  # huge exponent
    "<answer>٤٢</answer>",  # Arabic-Indic digits for 42
    "<answer>４２</answer>",  # full-width digits
    "<answer>\x00\ud800\u202e42</answer>",  # NUL, lone surrogate, RTL override
    "\\boxed{" * 10_000 + "42",  # unclosed boxes
    "<think>" * 5_000 + "</think>" * 5_000,
]


@pytest.mark.parametrize("backend", ["builtin", "auto"])
def test_hostile_completions_never_raise(backend):
    batch = make_batch(HOSTILE)
    start = time.perf_counter()
    scores = {}
    for mode in ("answer_tag", "boxed", "last_number"):
        scores[mode] = MathAnswerReward(extract=mode, backend=backend)(batch)
        assert all(s in (0.0, 1.0) for s in scores[mode])
    for reward in (ExactMatchReward(), ExactMatchReward(extract=None), ContainsReward(), FormatReward(),
                   FormatReward(strict=True)):
        assert len(reward(batch)) == len(HOSTILE)
    assert time.perf_counter() - start < 20.0
    tags = scores["answer_tag"]
    # Nested tags give no answer (0 with both backends); repeated blocks: the last one, "42", counts.
    assert tags[4] == 0.0 and tags[5] == 1.0
    assert tags[8] == 1.0 and tags[9] == 1.0  # unicode digits read as 42
    assert tags[0] == tags[1] == tags[2] == tags[3] == tags[6] == tags[7] == 0.0


def test_hostile_exact_and_format():
    batch = make_batch(HOSTILE)
    assert FormatReward()(batch) == [0.0] * len(HOSTILE)
    exact = ExactMatchReward()(batch)
    assert exact[5] == 1.0 and sum(exact) == 1.0  # only the repeated-tag completion ends in <answer>42</answer>


# ---------------------------------------------------------------- exact match / contains


def test_exact_match():
    batch = make_batch(
        ["<answer> Paris </answer>", "<answer>paris</answer>", "<answer>Paris, France</answer>", "Paris",
         "<answer>  </answer>"],
        answers=["Paris"] * 5,
    )
    assert ExactMatchReward()(batch) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert ExactMatchReward(ignore_case=False)(batch) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert ExactMatchReward(extract=None)(batch) == [0.0, 0.0, 0.0, 1.0, 0.0]


def test_exact_match_whitespace_and_aliases():
    batch = make_batch(["<answer>New\n  York</answer>", "<answer>NYC</answer>", "<answer>LA</answer>"],
                       answers=[["New York", "NYC"]] * 3)
    assert ExactMatchReward()(batch) == [1.0, 1.0, 0.0]
    assert ExactMatchReward(collapse_whitespace=False)(batch) == [0.0, 1.0, 0.0]


def test_exact_match_errors():
    with pytest.raises(ValueError, match="unknown extract mode"):
        ExactMatchReward(extract="first_word")
    with pytest.raises(KeyError, match="label"):
        ExactMatchReward(answer_key="label")(make_batch(["x"]))


def test_contains():
    batch = make_batch(["The capital is PARIS.", "It's Lyon", "", "<answer>paris</answer> Lyon"],
                       answers=["Paris"] * 4)
    assert ContainsReward()(batch) == [1.0, 0.0, 0.0, 1.0]
    assert ContainsReward(ignore_case=False)(batch) == [0.0, 0.0, 0.0, 0.0]
    assert ContainsReward(extract="answer_tag")(batch) == [0.0, 0.0, 0.0, 1.0]
    assert ContainsReward(values=["lyon", "marseille"])(batch) == [0.0, 1.0, 0.0, 1.0]
    assert ContainsReward(values="lyon")(batch) == [0.0, 1.0, 0.0, 1.0]
    # An empty target never matches (every string contains "").
    assert ContainsReward(values=[""])(batch) == [0.0] * 4
    assert ContainsReward()(make_batch(["anything"], answers=[""])) == [0.0]


def test_contains_from_yaml_with_negative_weight():
    rs = build_reward_set(
        [{"_component_": "torchtune_grpo.rewards.ContainsReward", "values": ["As an AI"], "weight": -0.5,
          "name": "refusal"}]
    )
    out = rs(make_batch(["As an AI, I cannot.", "42"]))
    assert out.total.tolist() == [-0.5, 0.0]


# ---------------------------------------------------------------- format: strict and soft


def test_format_strict_and_soft():
    completions = [
        "Reasoning.\n</think>\n<answer>\n42\n</answer>",  # both
        "Reasoning. </think> <answer> 42 </answer> trailing",  # soft only
        "<answer>42</answer>",  # neither: no </think>
    ]
    batch = make_batch(completions)
    assert FormatReward(strict=True)(batch) == [1.0, 0.0, 0.0]
    assert FormatReward(strict=False)(batch) == [1.0, 1.0, 0.0]


def test_module_constants():
    assert _math.BACKENDS == ("auto", "math_verify", "builtin")
