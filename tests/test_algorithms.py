"""Pure pieces of the algorithm family: dynamic sampling, the soft overlong reward, the algorithm card,
step metrics, config validation and entropy without gradient. Expected values are worked out by hand."""

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_grpo.config import validate_config
from tests.conftest import TINY_CONFIG
from torchtune_grpo.config.algorithm_card import AlgorithmSpec, algorithm_card
from torchtune_grpo.rollouts.group_selection import DynamicSampling, GroupSelection
from torchtune_grpo.rollouts.groups import RolloutGroups
from torchtune_grpo.models.logprobs import chunked_logprobs
from torchtune_grpo.rewards import RewardBatch, SoftOverlongPunishment
from torchtune_grpo.metrics.sums import Reduce, reduce_over_ranks
from torchtune_grpo.training.step_metrics import LOSS_METRICS, rollout_sums, step_metrics


def _groups(rewards, group_size=2, truncated=None, lengths=None):
    n = len(rewards)
    lengths = lengths or [3] * n
    return RolloutGroups(
        group_size=group_size,
        prompts=[f"p{i}" for i in range(n // group_size)],
        fields=[{"answer": str(i)} for i in range(n // group_size)],
        prompt_ids=[[1, 2]] * n,
        response_ids=[[7] * k for k in lengths],
        completions=[f"c{i}" for i in range(n)],
        truncated=torch.tensor(truncated or [False] * n),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        per_component={"r": torch.tensor(rewards, dtype=torch.float32)},
        errors={"r": 0},
    )


# ------------------------------------------------------------------------------------ dynamic sampling


def test_select_keeps_first_informative_groups():
    # groups: [1,1] flat, [0,1] ok, [0,0] flat, [1,0] ok, [0.3, 0.1+0.2] flat (float noise), [2,3] ok
    groups = _groups([1, 1, 0, 1, 0, 0, 1, 0, 0.3, 0.1 + 0.2, 2, 3])
    ds = DynamicSampling(enabled=True, max_rounds=3)
    assert ds.informative(groups).tolist() == [False, True, False, True, False, True]
    assert ds.select(groups, 2) == GroupSelection(indices=[1, 3], dropped=3, filled=0, surplus=1)
    assert ds.select(groups, 3) == GroupSelection(indices=[1, 3, 5], dropped=3, filled=0, surplus=0)
    # 5 needed but 3 informative: top up with the first 2 flat groups (0 and 2), keep generation order
    assert ds.select(groups, 5) == GroupSelection(indices=[0, 1, 2, 3, 5], dropped=1, filled=2, surplus=0)
    assert ds.needs_more(groups, 4) and not ds.needs_more(groups, 3)


def test_disabled_dynamic_sampling_is_one_round_of_everything():
    groups = _groups([1, 1, 0, 1])
    ds = DynamicSampling()
    assert ds.max_rounds == 1 and not ds.needs_more(groups, 2)
    assert ds.select(groups, 2) == GroupSelection(indices=[0, 1], dropped=0, filled=0, surplus=0)
    assert DynamicSampling(enabled=True, max_rounds=5).max_rounds == 5
    with pytest.raises(ValueError, match="max_rounds"):
        DynamicSampling(enabled=True, max_rounds=0)
    with pytest.raises(ValueError, match="fewer than"):
        ds.select(groups, 3)


def test_rollout_groups_select_and_concat():
    a = _groups([1, 1, 0, 1], truncated=[False, True, False, False])
    b = _groups([5, 6], truncated=[True, True])
    b.errors = {"r": 2}
    both = RolloutGroups.concat([a, b])
    assert both.num_groups == 3 and both.errors == {"r": 2}
    assert both.rewards.tolist() == [1, 1, 0, 1, 5, 6]
    picked = both.select([2, 0])
    assert picked.prompts == ["p0", "p0"]  # b's first prompt is also named p0
    assert picked.rewards.tolist() == [5, 6, 1, 1]
    assert picked.truncated.tolist() == [True, True, False, True]
    assert picked.per_component["r"].tolist() == [5, 6, 1, 1]
    assert picked.completions == ["c0", "c1", "c0", "c1"]


# ------------------------------------------------------------------------------ soft overlong reward


def test_soft_overlong_punishment_by_hand():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then (6 - |y|) / 4, -1 beyond 10.
    #   |y| = 0, 6 -> 0; 7 -> -0.25; 8 -> -0.5; 10 -> -1; 11 -> -1
    reward = SoftOverlongPunishment(max_length=10, buffer_length=4)
    lengths = [0, 6, 7, 8, 10, 11]
    batch = RewardBatch(
        prompts=["q"] * 6, completions=["x"] * 6, completion_ids=[[1] * k for k in lengths], fields=[{}] * 6
    )
    assert reward(batch) == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert reward.name == "soft_overlong"
    with pytest.raises(ValueError, match="buffer_length"):
        SoftOverlongPunishment(max_length=10, buffer_length=11)
    with pytest.raises(ValueError, match="max_length"):
        SoftOverlongPunishment(max_length=0, buffer_length=1)


# ------------------------------------------------------------------------------------- step metrics


def test_step_metrics_by_hand():
    # 4 completions, lengths [2, 4, 6, 8], truncated [F, F, T, F]; rewards [1, 0 | 1, 1] (group 1 flat).
    generated = _groups([1, 0, 1, 1], truncated=[False, False, True, False], lengths=[2, 4, 6, 8])
    zero_std = torch.tensor([False, True])
    sums = rollout_sums(generated, zero_std, GroupSelection([0, 1], dropped=0, filled=1, surplus=0))
    assert sums[("terminated_tokens",)] == 14 and sums[("terminated",)] == 3 and sums[("truncated",)] == 1
    for name, value in zip(LOSS_METRICS, (0.25, 0.2, 0.05, 0.0, 0.5, 1.0)):  # half of each global sum per rank
        sums.add(("update", name), value)
    sums.add(("kl_penalty",), 0.3)
    sums.add(("trained",), 4)
    # Two identical "ranks": sums double, extremes stay.
    reduced = reduce_over_ranks(sums, lambda values, op: [2 * v for v in values] if op is Reduce.SUM else values)
    m = step_metrics(reduced)
    # Metric sums are float64 (python floats) of small exact values; each metric is a division or a square root of
    # them: one or two roundings at 1e-16 relative. Bound: approx's default 1e-6 relative, far above.
    assert m["reward/mean"] == pytest.approx(0.75)  # (1 + 0 + 1 + 1) / 4
    assert m["reward/std"] == pytest.approx(0.75**0.5 * 0.25**0.5)  # population std of {1, 0, 1, 1}
    assert m["response_length/mean"] == 5.0  # 20 / 4
    assert m["response_length/terminated_mean"] == pytest.approx(14 / 3)  # (2 + 4 + 8) / 3
    assert m["truncated_fraction"] == 0.25
    assert m["zero_std_fraction"] == 0.5
    assert m["reward/kl_penalty"] == pytest.approx(0.6 / 8)
    assert m["dynamic_sampling/groups_filled"] == 2.0
    assert m["reward/r/mean"] == pytest.approx(0.75) and m["reward/r/errors"] == 0.0
    assert m["entropy"] == 2.0 and m["loss"] == 0.5
    assert m["response_length/max"] == 8.0 and m["response_length/min"] == 2.0


# ------------------------------------------------------------------------------------ algorithm card


def _spec(**kw):
    base = dict(
        world_size=2, batch_size=4, group_size=8, micro_batch_size=16, ppo_epochs=1, max_response_length=512,
        advantage="A_i = R_i - mean(R_group)", rewards=[("correctness", 1.0), ("format", 0.5)],
    )
    return AlgorithmSpec(**{**base, **kw})


def test_card_batch_arithmetic():
    card = algorithm_card(_spec(ppo_epochs=4, micro_batch_size=5))
    assert "| prompts per optimizer step | 8 | batch_size 4 x 2 process(es) |" in card
    assert "| sequences per optimizer step (effective global batch) | 64 |" in card
    assert "| micro-batches per process per optimizer step | 7 | ceil(32 / micro_batch_size 5)" in card
    assert "| optimizer steps per generation round | 4 |" in card and "up to 3 update(s) stale" in card
    assert "| prompts consumed per step | 8 |" in card
    assert "| reference model | not loaded | kl_coef = 0 |" in card
    assert "reward     R_i = 1 * correctness + 0.5 * format" in card
    dyn = algorithm_card(_spec(dynamic_sampling=True, max_rounds=3))
    assert "| prompts consumed per step | 8 to 24 (4 x 2 per round, 1 to 3 rounds) |" in dyn
    # 2 passes x 4 mini-batches: 8 prompts x 8 samples per round, so 2 prompts = 16 sequences per optimizer
    # step, 16 local rows / micro_batch_size 5 -> ceil(8 / 5) = 2 micro-batches; updates 2..8 are 1..7 behind.
    mini = algorithm_card(_spec(ppo_epochs=2, ppo_mini_batches=4, micro_batch_size=5))
    assert (
        "| prompts per optimizer step | 2 | batch_size 4 x 2 process(es) / ppo_mini_batches 4 (whole groups, "
        "reshuffled before every pass) |"
    ) in mini
    assert "| sequences per optimizer step (effective global batch) | 16 |" in mini
    assert "| micro-batches per process per optimizer step | 2 | ceil(8 / micro_batch_size 5)" in mini
    assert "| optimizer steps per generation round | 8 | ppo_epochs 2 x ppo_mini_batches 4; update 1 is on-policy" in mini
    assert "up to 7 update(s) stale (each pass splits the rollouts into 4 disjoint mini-batches" in mini
    assert "| prompts consumed per step | 8 | one generation round per step |" in mini
    # A token budget: at least ceil(32 / 5) = 7 micro-batches (the row cap), at most one per sequence.
    budget = algorithm_card(_spec(micro_batch_size=5, max_tokens_per_micro_batch=4096))
    assert (
        "| micro-batches per process per optimizer step | 7 to 32 | by length: up to max_tokens_per_micro_batch "
        "4096 tokens (padding included) and micro_batch_size 5 sequences each"
    ) in budget


@pytest.mark.parametrize(
    "mode, line",
    [
        ("token-mean", "loss       L = (1 / M) * sum_i sum_t l_i,t   [token-mean"),
        ("seq-mean-token-mean", "loss       L = (1 / N) * sum_i (1 / |o_i|) * sum_t l_i,t   [seq-mean-token-mean"),
        ("seq-mean-token-sum", "loss       L = (1 / N) * sum_i sum_t l_i,t   [seq-mean-token-sum:"),
        ("seq-mean-token-sum-norm", "loss       L = (1 / (N * 512)) * sum_i sum_t l_i,t   [seq-mean-token-sum-norm"),
    ],
)
def test_card_aggregation_formula(mode, line):
    assert line in algorithm_card(_spec(loss_agg_mode=mode))


def test_card_kl_clip_entropy_and_ratio():
    card = algorithm_card(
        _spec(kl_coef=0.04, kl_estimator="k3", reference_model=True, epsilon_high=0.28, dual_clip=3.0,
              entropy_coef=0.01)
    )
    assert "policy     p_i,t = -min(rho_i,t * A_i, clip(rho_i,t, 1 - 0.2, 1 + 0.28) * A_i)" in card
    assert "min(p_i,t, -3 * A_i) where A_i < 0" in card
    assert "per token  l_i,t = p_i,t + 0.04 * k3_i,t - 0.01 * H_i,t" in card
    assert "k3 = exp(d) - d - 1" in card and "| reference model | loaded" in card
    reward_kl = algorithm_card(_spec(kl_coef=0.1, kl_estimator="k1", kl_placement="reward", reference_model=True))
    assert "per token  l_i,t = p_i,t\n" in reward_kl
    assert "R_i = 1 * correctness + 0.5 * format - 0.1 * sum_t k1(log pi_old, log pi_ref)_i,t" in reward_kl
    gspo = algorithm_card(_spec(ratio_level="sequence"))
    assert "s_i = exp((1 / |o_i|) * sum_t" in gspo
    masked = algorithm_card(_spec(mask_truncated_completions=True))
    assert "N = number of sequences not truncated" in masked
    custom = algorithm_card(_spec(loss_agg_mode=None, loss_name="MyLoss"))
    assert "Custom loss component `MyLoss`" in custom
    tis = algorithm_card(_spec(tis_cap=2.0))
    assert "times min(pi_old(o_i,t) / mu(o_i,t), 2), mu = the generation engine's sampling probability" in tis
    assert "truncated importance sampling" not in algorithm_card(_spec())


def test_card_states_that_environment_tokens_are_masked():
    card = algorithm_card(_spec(environment="ToolEnvironment, at most 4 turns"))
    assert "answers prompt q with episode o_i of |o_i| action tokens (environment tokens excluded)" in card
    assert "M = their action tokens (the model's own)" in card
    assert "- Multi-turn episodes (ToolEnvironment, at most 4 turns): o_i is a whole episode" in card
    assert "masked out of every loss term (policy, ratio, KL, entropy, the KL-in-reward sum)" in card
    single = algorithm_card(_spec())
    assert "Multi-turn" not in single and "M = their response tokens" in single
    assert "answers prompt q with completion o_i of |o_i| tokens" in single


# ------------------------------------------------------------------------------- config validation


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"kl_estimator": "k9"}, "kl_estimator must be one of"),
        ({"kl_placement": "advantage"}, "kl_placement must be one of"),
        ({"loss.kl_estimator": "k2"}, "Set kl_estimator at the top level"),
        ({"dynamic_sampling": {"enabled": True, "max_round": 3}}, "Unknown dynamic_sampling key"),
        ({"rollout_correction": {"mode": "mask"}, "loss.tis_cap": 2.0}, "either loss.tis_cap or rollout_correction"),
        # the tiny config has batch_size 4: 3 mini-batches cannot take equal whole groups
        ({"ppo_mini_batches": 3}, r"batch_size = 4 \(groups per rank\) is not divisible by ppo_mini_batches = 3"),
        ({"ppo_mini_batches": 0}, r"ppo_mini_batches must be >= 1 \(optimizer steps per pass.*got 0"),
        ({"dtype": "fp16"}, r"dtype must be one of \['bf16', 'bf16_pure', 'fp32'\], got 'fp16'"),
    ],
)
def test_validation_of_algorithm_keys(overrides, message):
    cfg = OmegaConf.load(TINY_CONFIG)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(ValueError, match=message):
        validate_config(cfg)


def test_entropy_without_gradient_has_same_values():
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 20, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 20, (2, 5))
    with_grad = chunked_logprobs(hidden, targets, proj, chunk_size=3, with_entropy=True)
    logged = chunked_logprobs(hidden, targets, proj, chunk_size=3, with_entropy=True, entropy_grad=False)
    torch.testing.assert_close(logged.entropy, with_grad.entropy)
    torch.testing.assert_close(logged.logprobs, with_grad.logprobs)
    assert with_grad.entropy.requires_grad
    # The logged entropy is a constant: its gradient wrt the hidden states is zero.
    grad = torch.autograd.grad(logged.entropy.sum() + 0 * logged.logprobs.sum(), hidden)[0]
    assert torch.equal(grad, torch.zeros_like(grad))


def test_metrics_reduce_by_key_and_ranks_with_other_keys_fail_loudly():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from torchtune_grpo.metrics.sums import StepSums

    a, b = StepSums(), StepSums()
    a.add(("component", "format"), 1.0)
    a.add(("component", "correctness"), 2.0)
    a.add(("longest",), 7.0, Reduce.MAX)
    a.add(("shortest",), 3.0, Reduce.MIN)
    b.add(("shortest",), 1.0, Reduce.MIN)  # another insertion order: reduced by key, not position
    b.add(("longest",), 9.0, Reduce.MAX)
    b.add(("component", "correctness"), 20.0)
    b.add(("component", "format"), 10.0)

    def two_ranks(first, second):
        # Each "rank" runs reduce_over_ranks in its own thread; the fake collective exchanges their lists.
        barrier, slots = threading.Barrier(2, timeout=10), [None, None]

        def rank(r, sums):
            def all_reduce(values, op):
                slots[r] = values
                barrier.wait()
                other = slots[1 - r]
                assert len(other) == len(values)
                out = [x + y if op is Reduce.SUM else max(x, y) for x, y in zip(values, other)]
                barrier.wait()
                return out

            return reduce_over_ranks(sums, all_reduce)

        with ThreadPoolExecutor(2) as pool:
            results = [pool.submit(rank, 0, first), pool.submit(rank, 1, second)]
            return [f.result() for f in results]

    reduced, other = two_ranks(a, b)
    assert reduced == other == {("component", "correctness"): 22.0, ("component", "format"): 11.0, ("longest",): 9.0,
                       ("shortest",): 1.0}
    c = StepSums()  # same number of values, another reward's name: must not be added to "format"
    for key, value in b.items():
        c.add(("component", "length") if key == ("component", "format") else key, value, b.op(key))
    with pytest.raises(RuntimeError, match=r"The ranks computed different metrics this step"):
        two_ranks(a, c)
    # One rank with a key more (an episode counter only its own rollouts produced, say): every collective still has
    # the same length on both ranks (the fake asserts it: on gloo a mismatch aborts the process, SIGABRT, before any
    # check after it could run), and both ranks raise.
    d = StepSums().merge(b)
    d.add(("errors", "environment"), 1.0)
    with pytest.raises(RuntimeError, match=r"The ranks computed different metrics this step"):
        two_ranks(a, d)
    e = StepSums()  # the same keys, one reduced by max on one rank only: as many sums on each rank would not be
    for key, value in b.items():
        e.add(key, value, Reduce.MAX if key == ("component", "format") else b.op(key))
    with pytest.raises(RuntimeError, match=r"The ranks computed different metrics this step"):
        two_ranks(a, e)
    with pytest.raises(ValueError, match=r"metric \('longest',\) is reduced by max, not sum"):
        a.add(("longest",), 1.0)
