"""Advantage estimators, expected values worked out by hand."""

import math

import pytest
import torch

from torchtune_grpo.rollouts.advantages import (
    AdvantageOutput,
    BatchStdAdvantage,
    GroupRelativeAdvantage,
    RewardStats,
    RLOOAdvantage,
    zero_variance_groups,
)


def test_two_groups_of_two():
    # rewards [1, 0 | 0, 1], G = 2.
    # group 0: mean 0.5, sample std = sqrt(((1-.5)^2 + (0-.5)^2) / (2-1)) = sqrt(0.5) = 0.70711
    #   A = (+-0.5) / (0.70711 + 1e-6) = +-0.70711
    # group 1: the mirror image.
    out = GroupRelativeAdvantage()(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    assert isinstance(out, AdvantageOutput)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out.advantages, torch.tensor([a, -a, -a, a]))
    assert out.advantages.dtype == torch.float32
    assert out.zero_std.dtype == torch.bool
    assert out.zero_std.tolist() == [False, False]


def test_group_of_four_uses_sample_std():
    # rewards [1, 0, 0, 0], G = 4: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25]
    # sum of squares = 0.5625 + 3 * 0.0625 = 0.75; sample var = 0.75 / 3 = 0.25; std = 0.5
    # A = deviations / 0.5 = [1.5, -0.5, -0.5, -0.5]
    # (the population std would be sqrt(0.75 / 4) = 0.433 and give A[0] = 1.732)
    out = GroupRelativeAdvantage(eps=0.0)(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(out.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_eps_is_added_to_std():
    # same group, eps = 0.5: A = deviations / (0.5 + 0.5) = [0.75, -0.25, -0.25, -0.25]
    out = GroupRelativeAdvantage(eps=0.5)(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(out.advantages, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_no_std_scaling():
    # Dr. GRPO: A = r - mean = [1 - 0.25, -0.25, -0.25, -0.25] and [2 - 3, 4 - 3, ...]
    # group 1: [2, 4, 3, 3], mean 3 -> [-1, 1, 0, 0]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 3.0, 3.0])
    out = GroupRelativeAdvantage(scale_by_std=False)(rewards, group_size=4)
    torch.testing.assert_close(out.advantages, torch.tensor([0.75, -0.25, -0.25, -0.25, -1.0, 1.0, 0.0, 0.0]))


def test_equal_rewards_give_exactly_zero():
    # group 0 [1, 1]: all equal -> 0; group 1 [0, 0] -> 0;
    # group 2 [0.3, 0.1 + 0.2]: 0.1 + 0.2 = 0.30000000000000004, a spread of 5.6e-17 <= 1e-6 -> 0, not
    #   (5.6e-17 / 2) / (std 3.9e-17 + 1e-6) noise;
    # group 3 [1e7, 1e7 + 1e-3]: spread 1e-3 <= 1e-6 * |mean| = 10 -> 0 (relative tolerance);
    # group 4 [2, 3]: mean 2.5, std sqrt(0.5) -> +-0.70711
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.3, 0.1 + 0.2, 1e7, 1e7 + 1e-3, 2.0, 3.0], dtype=torch.float64)
    out = GroupRelativeAdvantage()(rewards, group_size=2)
    assert out.zero_std.tolist() == [True, True, True, True, False]
    assert out.advantages[:8].tolist() == [0.0] * 8  # exactly zero
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(out.advantages[8:], torch.tensor([-a, a]))


def test_group_size_one_is_all_zero():
    # a single sample has nothing to be compared with: zero_std, A = 0 (no NaN from the unbiased std)
    out = GroupRelativeAdvantage()(torch.tensor([1.0, 0.0, 5.0]), group_size=1)
    assert out.advantages.tolist() == [0.0, 0.0, 0.0]
    assert out.zero_std.tolist() == [True, True, True]


def test_advantages_sum_to_zero_per_group():
    torch.manual_seed(0)
    rewards = torch.rand(6 * 8)
    out = GroupRelativeAdvantage()(rewards, group_size=8)
    # Each group's 8 advantages (|A| <= ~2: centred rewards in [0, 1] over a std of ~0.3) sum to 0 up to the fp32
    # rounding of the mean (subtracted from each), the division and the sum of 8: ~8 roundings at <= 2 (ulp 2.4e-7),
    # ~2e-6 worst case. Bound: 1e-5. The sample std of A is exactly std / (std + 1e-6), 1 - 3e-6 at std ~0.3, plus
    # a few roundings at 1 (1.2e-7 each): bound 1e-4.
    torch.testing.assert_close(out.advantages.view(6, 8).sum(1), torch.zeros(6), atol=1e-5, rtol=0)
    # and each group has sample std 1 (up to eps)
    torch.testing.assert_close(out.advantages.view(6, 8).std(1), torch.ones(6), atol=1e-4, rtol=0)


def test_validation():
    adv = GroupRelativeAdvantage()
    with pytest.raises(ValueError, match="multiple of group_size"):
        adv(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="1-D"):
        adv(torch.zeros(2, 2), group_size=2)
    with pytest.raises(ValueError, match="positive integer"):
        adv(torch.zeros(4), group_size=0)
    with pytest.raises(ValueError, match="finite"):
        adv(torch.tensor([1.0, float("nan")]), group_size=2)


def test_empty_batch():
    out = GroupRelativeAdvantage()(torch.zeros(0), group_size=4)
    assert out.advantages.shape == (0,)
    assert out.zero_std.shape == (0,)


# ------------------------------------------------------------------------------------------------ RLOO


def test_rloo_leave_one_out_baseline():
    # rewards [1, 0, 0, 0], G = 4:
    #   i = 0: baseline mean(0, 0, 0) = 0      -> A = 1
    #   i = 1: baseline mean(1, 0, 0) = 1/3    -> A = -1/3 (same for i = 2, 3)
    # group [2, 4, 3, 3]: i=0: mean(4,3,3) = 10/3 -> -4/3; i=1: mean(2,3,3) = 8/3 -> 4/3;
    #   i=2,3: mean(2,4,3) = 3 -> 0
    out = RLOOAdvantage()(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0, 3.0, 3.0]), group_size=4)
    torch.testing.assert_close(
        out.advantages, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3, -4 / 3, 4 / 3, 0.0, 0.0])
    )
    assert out.zero_std.tolist() == [False, False]


def test_rloo_equals_rescaled_centring():
    torch.manual_seed(0)
    rewards = torch.rand(5 * 6)
    rloo = RLOOAdvantage()(rewards, group_size=6).advantages
    centred = GroupRelativeAdvantage(scale_by_std=False)(rewards, group_size=6).advantages
    torch.testing.assert_close(rloo, centred * 6 / 5)


def test_rloo_zero_variance_group_is_exactly_zero():
    out = RLOOAdvantage()(torch.tensor([0.3, 0.1 + 0.2, 1.0, 0.0], dtype=torch.float64), group_size=2)
    assert out.advantages[:2].tolist() == [0.0, 0.0]
    assert out.zero_std.tolist() == [True, False]


# ------------------------------------------------------------------------------------------- batch std


def test_batch_std_by_hand():
    # rewards [1, 0 | 3, 1], G = 2. Group means 0.5 and 2 -> centred [0.5, -0.5, 1, -1].
    # Batch: mean 1.25, deviations [-0.25, -1.25, 1.75, -0.25], squares sum 4.75,
    # sample var 4.75 / 3 = 1.583333, std 1.258306 -> A = centred / 1.258306.
    out = BatchStdAdvantage(eps=0.0)(torch.tensor([1.0, 0.0, 3.0, 1.0]), group_size=2)
    std = math.sqrt(4.75 / 3)
    torch.testing.assert_close(out.advantages, torch.tensor([0.5, -0.5, 1.0, -1.0]) / std)


def test_batch_std_uses_global_statistics_across_processes():
    # Two "ranks" hold one group each. Each alone would divide by its own batch std; with the summed
    # statistics (what the recipe all-reduces) both halves equal the single-process result.
    rewards = torch.tensor([1.0, 0.0, 3.0, 1.0])
    full = BatchStdAdvantage()(rewards, group_size=2).advantages
    halves = [rewards[:2], rewards[2:]]
    stats = [RewardStats.of(h) for h in halves]
    summed = RewardStats(*[sum(v) for v in zip(*stats)])
    assert summed == RewardStats(4.0, 5.0, 11.0)  # count, sum 1+0+3+1, squares 1+0+9+1
    split = torch.cat([BatchStdAdvantage()(h, group_size=2, batch_stats=summed).advantages for h in halves])
    # The split uses the same global statistics as the whole (float64 sums of exact small rewards, hence the same
    # std); the centred rewards +-0.5, +-1 are exact, so both divide the same numbers by the same fp32 std: equal, or
    # one rounding apart (1.2e-7 at |A| <= 0.8). Bound: 1e-6.
    torch.testing.assert_close(split, full, atol=1e-6, rtol=0)
    # Without the global statistics the rank-local std differs: the reason the recipe passes them.
    local = torch.cat([BatchStdAdvantage()(h, group_size=2).advantages for h in halves])
    # The local std changes the advantages by ~0.3 (measured 0.31), 1e4 times allclose's 1e-5 relative: a difference of
    # the statistics, not of rounding.
    assert not torch.allclose(local, full)


def test_reward_stats_std():
    # [1, 0, 3, 1]: sample std sqrt(4.75 / 3); fewer than two rewards -> 0.
    # Sums of exact small integers, then var and sqrt in float64 (or one fp32 rounding, 6e-8 relative): approx's
    # default 1e-6 relative.
    assert RewardStats.of(torch.tensor([1.0, 0.0, 3.0, 1.0])).std == pytest.approx(math.sqrt(4.75 / 3))
    assert RewardStats.of(torch.tensor([2.0])).std == 0.0
    assert RewardStats.of(torch.tensor([2.0, 2.0, 2.0])).std == 0.0


def test_only_batch_std_asks_for_global_statistics():
    assert BatchStdAdvantage.uses_batch_stats
    assert not GroupRelativeAdvantage.uses_batch_stats and not RLOOAdvantage.uses_batch_stats


# ------------------------------------------------------------------------------- clipping and formulas


def test_advantage_clipping():
    # [1, 0, 0, 0] with eps 0: [1.5, -0.5, -0.5, -0.5] (see above) -> clip 1.0 -> [1.0, -0.5, -0.5, -0.5]
    out = GroupRelativeAdvantage(eps=0.0, clip=1.0)(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(out.advantages, torch.tensor([1.0, -0.5, -0.5, -0.5]))
    # RLOO [1, 0, 0, 0] = [1, -1/3, ...] -> clip 0.25 -> [0.25, -0.25, -0.25, -0.25]
    out = RLOOAdvantage(clip=0.25)(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4)
    torch.testing.assert_close(out.advantages, torch.tensor([0.25, -0.25, -0.25, -0.25]))
    with pytest.raises(ValueError, match="clip"):
        RLOOAdvantage(clip=0.0)


def test_formulas():
    assert GroupRelativeAdvantage().formula == "A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-06)"
    assert GroupRelativeAdvantage(scale_by_std=False).formula == "A_i = R_i - mean(R_group)"
    assert RLOOAdvantage(clip=5).formula == "clip(A_i = R_i - mean_{j != i}(R_j in group), -5, 5)"
    assert "global batch" in BatchStdAdvantage().formula


def test_zero_variance_groups():
    # spreads: [0, 0] -> 0; [0, 1e-3] -> 1e-3 > 1e-6 (informative); [1e7, 1e7 + 1e-3] -> relative 1e-10
    rewards = torch.tensor([0.0, 0.0, 0.0, 1e-3, 1e7, 1e7 + 1e-3], dtype=torch.float64)
    assert zero_variance_groups(rewards, 2).tolist() == [True, False, True]
    assert zero_variance_groups(rewards, 2, rtol=0.0).tolist() == [True, False, False]
