"""RewardSet robustness: per-sample isolation, timeouts, fallbacks, error counts, malformed output, async."""

import asyncio
import logging
import threading
import time

import pytest
import torch

from torchtune_grpo.rewards import (
    OPTION_KEYS,
    Reward,
    RewardBatch,
    RewardOutputError,
    RewardSample,
    RewardSet,
    RewardTimeoutError,
    build_reward_set,
)
from torchtune_grpo.rewards._execution import run_each


def make_batch(completions, answers=None):
    n = len(completions)
    answers = answers if answers is not None else ["42"] * n
    return RewardBatch(
        prompts=["q"] * n,
        completions=list(completions),
        completion_ids=[[1, 2]] * n,
        fields=[{"answer": a} for a in answers],
    )


# ---------------------------------------------------------------- helpers used from YAML (dotted paths)


class LoopsOnHang(Reward):
    """Scores 1.0, except a completion "hang" loops forever in pure Python and "boom" raises."""

    name = "loops"

    def score_one(self, sample: RewardSample) -> float:
        if sample.completion == "hang":
            while True:
                pass
        if sample.completion == "boom":
            raise RuntimeError("boom on purpose")
        return 1.0


class BatchOnly(Reward):
    """A batch reward without score_one: per-sample mode must call it on 1-element sub-batches."""

    def __init__(self):
        self.batch_sizes = []

    def __call__(self, batch):
        self.batch_sizes.append(len(batch.completions))
        if "boom" in batch.completions:
            raise ValueError("bad sample")
        return [float(len(c)) for c in batch.completions]


# ---------------------------------------------------------------- per-sample isolation


def test_per_sample_exception_only_fails_that_sample(caplog):
    # 4 samples, one raises: it scores fallback -1, the others 1; errors counts 1.
    rs = RewardSet([LoopsOnHang()], weights=[2.0], per_sample=[True], fallback=-1.0)
    with caplog.at_level(logging.WARNING):
        out = rs(make_batch(["a", "boom", "c", "d"]))
    assert out.per_component["loops"].tolist() == [1.0, -1.0, 1.0, 1.0]
    assert out.total.tolist() == [2.0, -2.0, 2.0, 2.0]
    assert out.errors == {"loops": 1}
    assert "'loops' failed on 1 of 4" in caplog.text and "boom on purpose" in caplog.text


def test_batch_exception_fails_whole_batch():
    # Without per_sample the component is one call: its exception fails all 3 samples.
    reward = BatchOnly()
    out = RewardSet([reward], weights=[1.0], fallback=0.5)(make_batch(["ab", "boom", "c"]))
    assert out.per_component["batch_only"].tolist() == [0.5, 0.5, 0.5]
    assert out.errors == {"batch_only": 3}
    assert reward.batch_sizes == [3]


def test_per_sample_mode_slices_batch_rewards():
    # per_sample with a plain batch reward: called on 1-element batches; only "boom" fails.
    reward = BatchOnly()
    out = RewardSet([reward], weights=[1.0], per_sample=[True], fallback=0.0)(make_batch(["ab", "boom", "c"]))
    assert out.per_component["batch_only"].tolist() == [2.0, 0.0, 1.0]
    assert out.errors == {"batch_only": 1}
    assert reward.batch_sizes == [1, 1, 1]


def test_timeout_gives_fallback_and_stops_the_thread():
    # "hang" loops forever in pure Python: after 0.3 s it scores the fallback (counted), the other samples
    # are scored normally, and the cancelled worker thread really ends.
    before = threading.active_count()
    rs = RewardSet([LoopsOnHang()], weights=[1.0], timeouts=[0.3], fallbacks=[-0.5], concurrency=[2])
    assert rs.per_sample == [True]  # a timeout implies per-sample evaluation
    start = time.perf_counter()
    out = rs(make_batch(["a", "hang", "b", "c", "d"]))
    elapsed = time.perf_counter() - start
    assert out.per_component["loops"].tolist() == [1.0, -0.5, 1.0, 1.0, 1.0]
    assert out.errors == {"loops": 1}
    assert elapsed < 3.0
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_batch_level_timeout():
    # per_sample=False with a timeout: the whole call is limited; a slow call fails every sample.
    def slow(batch):
        time.sleep(2)
        return [1.0] * len(batch.completions)

    rs = RewardSet([slow], weights=[1.0], timeouts=[0.2], per_sample=[False], fallback=0.0)
    start = time.perf_counter()
    out = rs(make_batch(["a", "b"]))
    assert time.perf_counter() - start < 1.5
    assert out.errors == {"slow": 2}
    assert out.per_component["slow"].tolist() == [0.0, 0.0]


def test_run_each_concurrency_and_timeouts():
    # 8 calls of 0.2 s with 4 workers take about 0.4 s, not 1.6 s; index 3 hangs and times out alone.
    def fn(i):
        if i == 3:
            time.sleep(5)
        time.sleep(0.2)
        return i * 10

    start = time.perf_counter()
    outs = run_each(fn, 8, timeout=0.6, concurrency=4)
    elapsed = time.perf_counter() - start
    assert [o.status for o in outs] == ["ok"] * 3 + ["timeout"] + ["ok"] * 4
    assert [o.value for o in outs if o.status == "ok"] == [0, 10, 20, 40, 50, 60, 70]
    assert isinstance(outs[3].value, RewardTimeoutError)
    assert elapsed < 1.5


def test_exception_instances_mark_single_samples():
    # A batch reward may put an exception where a score cannot be given: that sample alone falls back.
    def partial(batch):
        return [1.0, ValueError("judge reply unreadable"), 0.25]

    out = RewardSet([partial], weights=[1.0], fallback=-1.0)(make_batch(["a", "b", "c"]))
    assert out.per_component["partial"].tolist() == [1.0, -1.0, 0.25]
    assert out.errors == {"partial": 1}


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize(
    "bad, match",
    [
        ([float("nan")], "non-finite"),
        ([None], "non-number"),
        (["0.5"], "non-number"),
        ([1.0, 2.0], "returned 2 scores"),
        ([], "returned 0 scores"),
    ],
)
def test_malformed_output_is_an_error_naming_the_component(per_sample, bad, match):
    # One sample: per-sample and batch calls see the same list. A malformed result is a bug: it raises.
    rs = RewardSet([lambda batch: bad], weights=[1.0], names=["buggy"], per_sample=[per_sample])
    with pytest.raises(RewardOutputError, match=match) as e:
        rs(make_batch(["a"]))
    assert "'buggy'" in str(e.value)


def test_score_one_nan_is_an_error():
    class NaNScore(Reward):
        def score_one(self, sample):
            return float("nan")

    with pytest.raises(ValueError, match="'na_n_score' returned a non-finite score at index 0"):
        RewardSet([NaNScore()], weights=[1.0], per_sample=[True])(make_batch(["a"]))


def test_reward_base_class_loops_over_score_one():
    class Len(Reward):
        def score_one(self, sample):
            return float(len(sample.completion))

    assert Len()(make_batch(["ab", "", "xyz"])) == [2.0, 0.0, 3.0]
    with pytest.raises(NotImplementedError):
        Reward()(make_batch(["a"]))
    # Even in batch mode, a score_one that raises fails only its own sample.
    out = RewardSet([LoopsOnHang()], weights=[1.0], fallback=-1.0)(make_batch(["a", "boom"]))
    assert out.per_component["loops"].tolist() == [1.0, -1.0] and out.errors == {"loops": 1}


def test_reward_attributes_are_defaults():
    # Attributes on the reward (timeout, fallback, concurrency) apply unless the set overrides them.
    class Slow(LoopsOnHang):
        timeout = 0.2
        fallback = -3.0

    rs = RewardSet([Slow()], weights=[1.0])
    assert rs.timeouts == [0.2] and rs.fallbacks == [-3.0] and rs.per_sample == [True]
    assert rs(make_batch(["hang", "x"])).per_component["slow"].tolist() == [-3.0, 1.0]
    rs = RewardSet([Slow()], weights=[1.0], fallbacks=[0.0], timeouts=[5.0])
    assert rs.timeouts == [5.0] and rs.fallbacks == [0.0]


def test_option_validation():
    with pytest.raises(ValueError, match="timeout of reward 'loops'"):
        RewardSet([LoopsOnHang()], weights=[1.0], timeouts=[0])
    with pytest.raises(ValueError, match="fallback of reward 'loops'"):
        RewardSet([LoopsOnHang()], weights=[1.0], fallbacks=[float("inf")])
    with pytest.raises(ValueError, match="concurrency"):
        RewardSet([LoopsOnHang()], weights=[1.0], concurrency=[0])
    with pytest.raises(ValueError, match="2 timeouts"):
        RewardSet([LoopsOnHang()], weights=[1.0], timeouts=[1, 2])


# ---------------------------------------------------------------- async rewards


class AsyncScore(Reward):
    async def score_one(self, sample):
        await asyncio.sleep(0.01)
        return 0.5


async def async_batch(batch):
    await asyncio.sleep(0)
    return [1.0] * len(batch.completions)


def test_async_rewards_batch_and_per_sample():
    rs = RewardSet(
        [AsyncScore(), async_batch, AsyncScore()],
        weights=[1.0, 1.0, 1.0],
        names=["a_loop", "a_batch", "a_each"],
        per_sample=[False, False, True],
        concurrency=[1, 1, 3],
    )
    out = rs(make_batch(["x", "y", "z"]))
    assert out.total.tolist() == [2.0, 2.0, 2.0]
    assert out.errors == {"a_loop": 0, "a_batch": 0, "a_each": 0}


def test_async_reward_inside_running_loop():
    # Called from code that already runs an event loop (a notebook): the coroutine runs in a helper thread.
    rs = RewardSet([async_batch], weights=[1.0])

    async def main():
        return rs(make_batch(["x"]))

    assert asyncio.run(main()).total.tolist() == [1.0]


def test_async_timeout():
    class Sleepy(Reward):
        async def score_one(self, sample):
            await asyncio.sleep(5 if sample.completion == "slow" else 0)
            return 1.0

    out = RewardSet([Sleepy()], weights=[1.0], timeouts=[0.3], fallback=0.0)(make_batch(["slow", "fast"]))
    assert out.per_component["sleepy"].tolist() == [0.0, 1.0]
    assert out.errors == {"sleepy": 1}


# ---------------------------------------------------------------- YAML options


def test_build_reward_set_pops_options():
    specs = [
        {
            "_component_": "tests.test_rewards_robustness.LoopsOnHang",
            "weight": 0.5,
            "name": "guarded",
            "timeout": 0.3,
            "fallback": -1.0,
            "concurrency": 2,
        },
        {"_component_": "torchtune_grpo.rewards.FormatReward", "per_sample": True},
    ]
    rs = build_reward_set(specs, fallback=0.25)
    assert rs.names == ["guarded", "format_reward"]
    assert rs.timeouts == [0.3, None]
    assert rs.fallbacks == [-1.0, 0.25]
    assert rs.per_sample == [True, True]
    assert rs.concurrency == [2, 1]
    out = rs(make_batch(["hang", "ok"]))
    assert out.per_component["guarded"].tolist() == [-1.0, 1.0]
    assert out.errors == {"guarded": 1, "format_reward": 0}
    # Sums of exact binary fractions (-1, 1, 0.25 and weights) in fp32: exact or one rounding; allclose's default
    # (1e-5 relative) far above.
    assert torch.allclose(out.total, torch.tensor([-0.5, 0.5]))
    assert set(OPTION_KEYS) == {"weight", "name", "timeout", "fallback", "per_sample", "concurrency"}


def test_errors_key_present_for_every_component_even_when_clean():
    out = build_reward_set([{"_component_": "torchtune_grpo.rewards.FormatReward"}])(make_batch([""]))
    assert out.errors == {"format_reward": 0}


def test_empty_batch():
    out = RewardSet([LoopsOnHang()], weights=[1.0], per_sample=[True])(make_batch([]))
    assert out.total.shape == (0,) and out.errors == {"loops": 0}


def test_system_exit_in_reward_code_fails_only_that_sample():
    # Reward code calling sys.exit() (or raising any BaseException) must not end the run or hang the set.
    class Exits(Reward):
        def score_one(self, sample):
            if sample.completion == "exit":
                raise SystemExit(1)
            return 1.0

    for timeout, concurrency in ((None, 1), (5.0, 1), (5.0, 2)):  # inline, one thread, two threads
        rs = RewardSet([Exits()], weights=[1.0], timeouts=[timeout], per_sample=[True], concurrency=[concurrency])
        out = rs(make_batch(["a", "exit", "b"]))
        assert out.per_component["exits"].tolist() == [1.0, 0.0, 1.0]
        assert out.errors == {"exits": 1}
    # Batch mode: the whole call fails, counted, and the run goes on.
    out = RewardSet([Exits()], weights=[1.0])(make_batch(["a", "exit"]))
    assert out.errors == {"exits": 2}
