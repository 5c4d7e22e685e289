"""A reward that never returns cannot hang a run (issue 33, item 9): a component without a ``timeout`` runs
under a default limit per call (batch mode stays batch mode), its samples get the fallback and are counted;
``timeout: null`` means no limit, with a watchdog naming the reward in the log while it runs long."""

import logging
import threading

import pytest
import torch

from torchtune_grpo.rewards import (
    build_reward_set,
    DEFAULT_REWARD_TIMEOUT,
    MathAnswerReward,
    Reward,
    RewardBatch,
    RewardSet,
)
from torchtune_grpo.runtime import waits
from torchtune_grpo.rewards import _reward_set

# Hanging rewards wait on this instead of sleeping, so the test can free their threads when it ends.
RELEASE = threading.Event()
CALLS = []


@pytest.fixture(autouse=True)
def _release_hung_threads():
    RELEASE.clear()
    CALLS.clear()
    yield
    RELEASE.set()


def make_batch(completions):
    n = len(completions)
    return RewardBatch(["p"] * n, list(completions), [[1]] * n, [{"answer": "1"}] * n)


def hangs(batch):
    """A batch reward that never returns (until the test ends)."""
    CALLS.append(len(batch.completions))
    RELEASE.wait(30)
    return [1.0] * len(batch.completions)


class Hangs(Reward):
    """The same as a YAML component."""

    def __call__(self, batch):
        return hangs(batch)


def hangs_on_hang(batch):
    """Hangs on the completion "hang", scores the others 1.0."""
    if "hang" in batch.completions:
        RELEASE.wait(30)
    return [1.0] * len(batch.completions)


def test_reward_without_timeout_runs_under_the_default_limit_in_batch_mode(caplog):
    rs = RewardSet([hangs], weights=[1.0], fallback=-1.0, default_timeout=0.5)
    # The default limit is a whole-call limit: the component stays in batch mode.
    assert rs.timeouts == [None] and rs.limits == [0.5] and rs.per_sample == [False]
    with caplog.at_level(logging.WARNING):
        out = rs(make_batch(["a", "b", "c", "d"]))
    assert CALLS == [4]  # one call for the whole batch
    assert out.per_component["hangs"].tolist() == [-1.0] * 4 and out.total.tolist() == [-1.0] * 4
    assert out.errors == {"hangs": 4}  # counted like any timeout
    assert "reward 'hangs' failed on 4 of 4 samples (4 RewardTimeoutError" in caplog.text
    assert "the default limit for a reward without a `timeout`" in caplog.text


def test_the_default_is_generous_and_fast_rewards_score_as_before():
    assert DEFAULT_REWARD_TIMEOUT == 300.0
    seen = {}

    def fast(batch):
        seen["grad"] = torch.is_grad_enabled()
        seen["main"] = threading.current_thread() is threading.main_thread()
        return [float(len(c)) for c in batch.completions]

    rs = RewardSet([fast], weights=[2.0])
    assert rs.timeouts == [None] and rs.limits == [300.0] and rs.per_sample == [False]
    with torch.no_grad():
        out = rs(make_batch(["ab", "abc"]))
    assert out.total.tolist() == [4.0, 6.0] and out.errors == {"fast": 0}
    # It ran in a worker thread (so it can be given up), with the caller's grad mode.
    assert seen == {"grad": False, "main": False}


def test_default_limit_per_sample_fails_only_the_hung_sample():
    rs = RewardSet([hangs_on_hang], weights=[1.0], per_sample=[True], default_timeout=0.5)
    assert rs.limits == [0.5] and rs.per_sample == [True]
    out = rs(make_batch(["ok", "hang", "ok"]))
    assert out.per_component["hangs_on_hang"].tolist() == [1.0, 0.0, 1.0]
    assert out.errors == {"hangs_on_hang": 1}


def test_yaml_default_and_timeout_null():
    spec = {"_component_": "tests.test_rewards_default_timeout.Hangs", "fallback": -2.0}
    rs = build_reward_set([spec], default_timeout=0.5)
    assert rs.limits == [0.5] and rs.per_sample == [False]
    out = rs(make_batch(["a", "b"]))
    assert out.per_component["hangs"].tolist() == [-2.0, -2.0] and out.errors == {"hangs": 2}

    # `timeout: null` asks for no limit: the call runs in the calling thread, as before the default.
    seen = []
    rs = build_reward_set([{"_component_": "torchtune_grpo.rewards.FormatReward", "timeout": None}])
    assert rs.timeouts == [None] and rs.limits == [None] and rs.per_sample == [False]
    original = rs.rewards[0].__call__
    rs.rewards[0] = lambda batch: seen.append(threading.current_thread() is threading.main_thread()) or original(batch)
    rs(make_batch(["<think>x</think> <answer>1</answer>"]))
    assert seen == [True]
    # An explicit number still means seconds per sample.
    assert build_reward_set([{"_component_": "torchtune_grpo.rewards.FormatReward", "timeout": 7}]).per_sample == [True]
    with pytest.raises(ValueError, match="default_timeout must be a positive number"):
        RewardSet([hangs], weights=[1.0], default_timeout=0)


def test_watchdog_names_a_reward_without_limit_that_runs_long(monkeypatch):
    monkeypatch.setattr(waits, "REPORT_EVERY", 0.05)
    logged = threading.Event()
    messages = []

    # A handler on the module's own logger, not caplog: another test in the same worker may have changed
    # how records propagate to the root logger (an in-process recipe configures logging).
    class Flag(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
            if "still waiting for reward" in record.getMessage():
                logged.set()

    handler = Flag(level=logging.WARNING)
    logger = logging.getLogger(_reward_set.__name__)
    logger.addHandler(handler)

    def slow(batch):
        logged.wait(30)  # returns once the watchdog has spoken (or after 30 s, and the test fails)
        return [1.0] * len(batch.completions)

    try:
        out = RewardSet([slow], weights=[1.0], timeouts=[float("inf")])(make_batch(["a"]))
    finally:
        logger.removeHandler(handler)
    assert logged.is_set() and out.errors == {"slow": 0}
    text = "\n".join(messages)
    assert "still waiting for reward 'slow' on a batch of 1 completions: " in text
    assert "(no limit, `timeout: null` in its entry)" in text


def test_math_reward_keeps_math_verify_limits_in_the_main_thread():
    # math-verify's own per-expression limits use signal.alarm (main thread only): that backend runs
    # without the default limit; the built-in comparison runs under it.
    assert RewardSet([MathAnswerReward(backend="math_verify")], weights=[1.0]).limits == [None]
    assert RewardSet([MathAnswerReward(backend="builtin")], weights=[1.0]).limits == [300.0]
    rs = RewardSet([MathAnswerReward(backend="math_verify")], weights=[1.0], timeouts=[5.0])
    assert rs.limits == [5.0] and rs.per_sample == [True]
