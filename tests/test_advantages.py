"""Group-relative advantages, expected values worked out by hand."""

import math

import pytest
import torch

from torchtune_grpo.advantages import AdvantageOutput, GroupRelativeAdvantage


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
