"""RolloutCorrection (torchtune_grpo/loss/rollout_correction.py): weights, masks and metrics worked out by hand, row-split
independence, the algorithm-card lines and errors. The recipe-level check (masks counted globally, 1 vs 4
micro-batches vs 2 processes) is tests/test_algorithms_recipe.py::test_every_variant_is_independent_of_micro_batches_and_processes."""

import math

import pytest
import torch

from torchtune_grpo.config.algorithm_card import AlgorithmSpec, algorithm_card
from torchtune_grpo.loss.rollout_correction import RolloutCorrection, correction_metrics

LN = math.log


def _batch(adv=(1.0, -1.0)):
    # log w = log pi_old - log mu:
    #   seq 0: [ln 3, 0, -ln 4]   -> w = [3, 1, 0.25]
    #   seq 1: [ln 1.5, ln 1.5, (padding: garbage)] -> w = [1.5, 1.5]
    mu = torch.tensor([[-2.0, -1.0, -1.0], [-1.0, -2.0, float("nan")]])
    old = mu + torch.tensor([[LN(3), 0.0, -LN(4)], [LN(1.5), LN(1.5), 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return old, mu, mask, torch.tensor(adv)


# KL(mu || pi_old), k3 per token r - 1 - ln r: w = 3: 2 - ln 3 = 0.901388; w = 1: 0; w = 0.25: ln 4 - 0.75
#   = 0.636294; w = 1.5: 0.5 - ln 1.5 = 0.094535 (twice). Sum 1.726753 over 5 tokens.
KL_SUM = (2 - LN(3)) + (LN(4) - 0.75) + 2 * (0.5 - LN(1.5))


def test_token_truncation_one_and_two_sided():
    old, mu, mask, adv = _batch()
    out = RolloutCorrection(level="token", mode="truncate", upper=2.0)(old, mu, mask, adv)
    # min(w, 2) = [2, 1, 0.25 | 1.5, 1.5]; nothing leaves; 1 token truncated (w = 3)
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 1.0, 0.25], [1.5, 1.5, 0.0]]))
    assert torch.equal(out.mask, mask) and out.kept.tolist() == [True, True]
    assert out.sums[("rollout_correction", "truncated")] == 1 and out.sums[("rollout_correction", "masked")] == 0
    # Per-token k3 in fp32 from log w = old - mu (old = mu + ln w rounded once, ulp <= 2.4e-7 at |old| < 4), then
    # w - 1 - log w: ~5 roundings at <= 3 (ulp 2.4e-7) per token, an error of ~1e-6 on each of 5 tokens in the
    # worst case, summed in float64. Bound: 1e-5 on the sum, 1e-6 on its mean over 5 tokens (below).
    assert out.sums[("rollout_correction", "kl")] == pytest.approx(KL_SUM, abs=1e-5)
    # two-sided [0.5, 2]: 0.25 is raised to 0.5, 2 tokens truncated
    out = RolloutCorrection(level="token", mode="truncate", upper=2.0, lower=0.5)(old, mu, mask, adv)
    torch.testing.assert_close(out.weights, torch.tensor([[2.0, 1.0, 0.5], [1.5, 1.5, 0.0]]))
    assert out.sums[("rollout_correction", "truncated")] == 2


def test_token_masking_is_icepop_two_sided():
    # [0.5, 2]: tokens with w = 3 and w = 0.25 leave the loss; the others keep their weight w.
    old, mu, mask, adv = _batch()
    out = RolloutCorrection(level="token", mode="mask", upper=2.0, lower=0.5)(old, mu, mask, adv)
    assert out.mask.tolist() == [[False, True, False], [True, True, False]]
    torch.testing.assert_close(out.weights, torch.tensor([[0.0, 1.0, 0.0], [1.5, 1.5, 0.0]]))
    assert out.kept.tolist() == [True, True]  # a token mask keeps every sequence in the count
    metrics = correction_metrics(out.sums)
    # 2 / 5 of exact counts, one float64 rounding (approx's default 1e-6 relative); the kl mean: as in
    # test_token_truncation_one_and_two_sided, ~1e-6 / 5 per-token error. Bound: 1e-6.
    assert metrics["rollout_correction/masked_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_correction/seq_masked_fraction"] == 0.0
    assert metrics["rollout_correction/kl"] == pytest.approx(KL_SUM / 5, abs=1e-6)


def test_sequence_level_geometric_mean():
    # seq 0: mean log w = (ln 3 + 0 - ln 4) / 3 = ln(0.75) / 3 -> w_0 = 0.75^(1/3) = 0.908560; seq 1: w_1 = 1.5.
    old, mu, mask, adv = _batch()
    w0 = 0.75 ** (1 / 3)
    out = RolloutCorrection(level="sequence", mode="mask", upper=1.4)(old, mu, mask, adv)
    # w_1 = 1.5 > 1.4: the whole of seq 1 leaves the loss and the sequence count
    assert out.kept.tolist() == [True, False]
    assert out.mask.tolist() == [[True, True, True], [False, False, False]]
    torch.testing.assert_close(out.weights, torch.tensor([[w0, w0, w0], [0.0, 0.0, 0.0]]))
    assert correction_metrics(out.sums)["rollout_correction/seq_masked_fraction"] == 0.5
    assert out.sums[("rollout_correction", "masked")] == 2
    out = RolloutCorrection(level="sequence", mode="truncate", upper=1.4)(old, mu, mask, adv)
    torch.testing.assert_close(out.weights, torch.tensor([[w0, w0, w0], [1.4, 1.4, 0.0]]))
    assert out.kept.tolist() == [True, True] and out.sums[("rollout_correction", "truncated")] == 2


def test_offpolicy_sequence_masking_drops_only_negative_advantages():
    # mean (log mu - log pi_old): seq 0 = -ln(0.75) / 3 = 0.095894 > delta 0.05; seq 1 = -ln 1.5 < 0.
    old, mu, mask, _ = _batch()
    opsm = RolloutCorrection(mode=None, offpolicy_threshold=0.05)
    kept_pos = opsm(old, mu, mask, torch.tensor([1.0, -1.0]))  # seq 0 has A > 0: kept
    assert kept_pos.kept.tolist() == [True, True] and torch.equal(kept_pos.weights, mask.float())
    dropped = opsm(old, mu, mask, torch.tensor([-1.0, -1.0]))  # seq 0 has A < 0: dropped
    assert dropped.kept.tolist() == [False, True]
    assert dropped.mask.tolist() == [[False, False, False], [True, True, False]]
    assert RolloutCorrection(mode=None, offpolicy_threshold=0.1)(old, mu, mask, torch.tensor([-1.0, -1.0])).kept.all()


def test_row_split_gives_the_same_decisions_and_sums():
    # Every decision looks only inside its own row, so splitting the rows (micro-batches, ranks) changes nothing;
    # the sums of the parts are the sums of the whole.
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(6, 5, generator=g) * 3
    old = mu + (torch.rand(6, 5, generator=g) - 0.5) * 0.6  # w in [0.74, 1.35]
    mask = torch.arange(5).unsqueeze(0) < torch.tensor([5, 2, 0, 4, 3, 1]).unsqueeze(1)
    adv = torch.randn(6, generator=g)
    for corr in (
        RolloutCorrection(level="token", mode="mask", upper=1.3, lower=0.8, offpolicy_threshold=0.05),
        RolloutCorrection(level="sequence", mode="mask", upper=1.2, lower=0.9),
        RolloutCorrection(level="sequence", mode="truncate", upper=1.1, lower=0.95, offpolicy_threshold=0.0),
    ):
        whole = corr(old, mu, mask, adv)
        parts = [corr(old[s], mu[s], mask[s], adv[s]) for s in (slice(0, 2), slice(2, 5), slice(5, 6))]
        torch.testing.assert_close(torch.cat([p.weights for p in parts]), whole.weights)
        assert torch.equal(torch.cat([p.mask for p in parts]), whole.mask)
        assert torch.equal(torch.cat([p.kept for p in parts]), whole.kept)
        for key, value in whole.sums.items():
            # Counts are exact; the kl sum adds the same fp32 per-token values (elementwise, row by row) in float64 in
            # another grouping: float64 roundings only (~1e-16 x the sum of |k3| < 1). Bound: 1e-9.
            assert sum(p.sums[key] for p in parts) == pytest.approx(value, abs=1e-9), key
        assert 0 < whole.mask.sum() < mask.sum()  # the case really masks something


def test_card_states_bounds_and_what_is_masked():
    spec = dict(world_size=1, batch_size=2, group_size=2, micro_batch_size=2, ppo_epochs=1, max_response_length=8,
                advantage="A")
    mis = RolloutCorrection(level="token", mode="mask", upper=2.0, lower=0.5, offpolicy_threshold=1e-3)
    card = algorithm_card(AlgorithmSpec(**spec, rollout_correction=mis.formula_lines()))
    assert "w_i,t = pi_old(o_i,t) / mu(o_i,t)" in card
    assert "p_i,t times w_i,t where 0.5 <= w_i,t <= 2; outside, the token leaves the loss" in card
    assert "A_i < 0 and (1 / |o_i|) * sum_t (log mu - log pi_old) > 0.001 leave the loss" in card
    assert "Rollout correction: weights and masks come from pi_old and mu only" in card
    seq = RolloutCorrection(level="sequence", mode="truncate", upper=3.0).formula_lines()
    assert "[geometric mean]" in seq[0] and "p_i,t times clip(w_i,t, 0, 3)" in seq[1]
    assert "Rollout correction" not in algorithm_card(AlgorithmSpec(**spec))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"level": "group"}, "rollout_correction.level"),
        ({"mode": "drop"}, "rollout_correction.mode"),
        ({"upper": 0.9}, "rollout_correction.upper must be > 1"),
        ({"lower": 1.5}, r"rollout_correction.lower must be in \(0, 1\)"),
        ({"offpolicy_threshold": -1.0}, "offpolicy_threshold must be >= 0"),
        ({"mode": None}, "needs offpolicy_threshold"),
    ],
)
def test_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**kwargs)


def test_no_metrics_without_a_correction():
    assert correction_metrics({("completions",): 4.0}) == {}
