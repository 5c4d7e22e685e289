"""GRPOLoss: hand-computed values, gradients, and micro-batch independence of every aggregation mode."""

import math

import pytest
import torch

from torchtune_grpo.loss import LOSS_AGG_MODES, GRPOLoss, LossOutput

LN2 = math.log(2.0)


def _on_policy():
    # B = 2, T = 3; seq 0 has 2 response tokens, seq 1 has 1. A = [1, -0.5].
    # logprobs == old_logprobs -> ratio 1 everywhere, so per-token loss = -min(1*A, clip(1)*A) = -A:
    #   seq 0: [-1, -1], seq 1: [+0.5]. num_tokens = 3, num_seqs = 2.
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    old = logprobs.detach().clone()
    adv = torch.tensor([1.0, -0.5])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return logprobs, old, adv, mask


@pytest.mark.parametrize(
    "mode, expected",
    [
        # sum over tokens (-1 - 1 + 0.5 = -1.5) / num_tokens 3
        ("token-mean", -1.5 / 3),
        # seq means: -1 and +0.5; (-1 + 0.5) / num_seqs 2
        ("seq-mean-token-mean", (-1.0 + 0.5) / 2),
        # seq sums: -2 and +0.5; (-2 + 0.5) / num_seqs 2
        ("seq-mean-token-sum", (-2.0 + 0.5) / 2),
        # Dr. GRPO with max_response_length 4: -1.5 / (2 * 4) = -0.1875
        ("seq-mean-token-sum-norm", -1.5 / 8),
    ],
)
def test_on_policy_values(mode, expected):
    logprobs, old, adv, mask = _on_policy()
    out = GRPOLoss(loss_agg_mode=mode, max_response_length=4)(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
    assert isinstance(out, LossOutput)
    assert out.loss.item() == pytest.approx(expected, abs=1e-7)
    assert out.policy_loss.item() == pytest.approx(expected, abs=1e-7)
    assert out.kl.item() == 0.0  # kl_coef 0 and no ref: metric is 0
    assert out.clip_fraction.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)  # 3 tokens of ratio 1 / 3
    assert not out.policy_loss.requires_grad and not out.kl.requires_grad


def test_on_policy_gradient_is_minus_advantage_over_num_tokens():
    # d/dlogp of -ratio*A / n with ratio = exp(logp - old) = 1 is -A * ratio / n = -A / 3
    logprobs, old, adv, mask = _on_policy()
    out = GRPOLoss()(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
    out.loss.backward()
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [0.5 / 3, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def _off_policy():
    # eps = 0.2, so the clip range is [0.8, 1.2]. old_logprobs = -1 on every token; ratios:
    #   seq 0, A = +1: [1.5, 0.5, 1.1]
    #   seq 1, A = -1: [0.5, 1.5, (padding)]
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 1.0]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logprobs, old, adv, mask


def test_off_policy_clipped_values_and_gradients():
    # Per-token loss -min(rho*A, clip(rho, 0.8, 1.2)*A):
    #   seq 0 (A=+1): rho 1.5 -> -min(1.5, 1.2) = -1.2  (clipped branch: no gradient)
    #                 rho 0.5 -> -min(0.5, 0.8) = -0.5  (unclipped)
    #                 rho 1.1 -> -min(1.1, 1.1) = -1.1  (inside the range)
    #   seq 1 (A=-1): rho 0.5 -> -min(-0.5, -0.8) = 0.8 (clipped branch: no gradient)
    #                 rho 1.5 -> -min(-1.5, -1.2) = 1.5 (unclipped)
    # token-mean: (-1.2 - 0.5 - 1.1 + 0.8 + 1.5) / 5 = -0.5 / 5 = -0.1
    # clip_fraction: 2 clipped tokens / 5 = 0.4
    # ratio_mean: (1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5 = 5.1 / 5 = 1.02
    logprobs, old, adv, mask = _off_policy()
    out = GRPOLoss(epsilon=0.2)(logprobs, old, adv, mask, num_tokens=5, num_seqs=2)
    assert out.loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.4)
    assert out.ratio_mean.item() == pytest.approx(1.02, abs=1e-6)
    out.loss.backward()
    # gradient -A * rho / num_tokens where unclipped, 0 where clipped (and on padding):
    #   seq 0: [0, -0.5/5, -1.1/5] = [0, -0.1, -0.22]
    #   seq 1: [0, +1.5/5, 0]      = [0, 0.3, 0]
    expected = torch.tensor([[0.0, -0.1, -0.22], [0.0, 0.3, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected)


def test_clip_higher():
    # epsilon_high = 0.6: range [0.8, 1.6], so seq 0's rho 1.5 (A=+1) is no longer clipped:
    #   tokens: -1.5, -0.5, -1.1, 0.8, 1.5 -> sum -0.8 -> token-mean -0.16; 1 clipped token / 5 = 0.2
    logprobs, old, adv, mask = _off_policy()
    out = GRPOLoss(epsilon=0.2, epsilon_high=0.6)(logprobs, old, adv, mask, num_tokens=5, num_seqs=2)
    assert out.loss.item() == pytest.approx(-0.16, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.2)
    out.loss.backward()
    # seq 0 token 0 now has gradient -A * rho / 5 = -1.5 / 5 = -0.3
    assert logprobs.grad[0, 0].item() == pytest.approx(-0.3, abs=1e-6)


def test_k3_kl_value_and_gradient():
    # One sequence, two tokens, A = 0 (no policy term), on policy. ref - logp = d = [ln 2, -ln 2]:
    #   k3 = exp(d) - d - 1 = [2 - ln2 - 1, 0.5 + ln2 - 1] = [0.306853, 0.193147]; sum 0.5; token-mean 0.25
    #   loss = kl_coef * 0.25 = 0.1 * 0.25 = 0.025
    #   d k3 / d logp = -exp(d) + 1 = [-1, 0.5]; times kl_coef / num_tokens = 0.1 / 2 -> [-0.05, 0.025]
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = logprobs.detach() + torch.tensor([[LN2, -LN2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = GRPOLoss(kl_coef=0.1)(
        logprobs, logprobs.detach(), torch.zeros(1), mask, ref_logprobs=ref, num_tokens=2, num_seqs=1
    )
    assert out.kl.item() == pytest.approx(0.25, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.025, abs=1e-7)
    assert out.policy_loss.item() == 0.0
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.05, 0.025]]))


def test_kl_metric_without_penalty():
    # kl_coef = 0 with ref given: KL is reported (0.25 as above) but adds nothing to the loss.
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = logprobs.detach() + torch.tensor([[LN2, -LN2]])
    out = GRPOLoss()(
        logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool),
        ref_logprobs=ref, num_tokens=2, num_seqs=1,
    )
    assert out.kl.item() == pytest.approx(0.25, abs=1e-6)
    assert out.loss.item() == 0.0


def test_errors():
    with pytest.raises(ValueError, match="token-mean"):  # lists the valid modes
        GRPOLoss(loss_agg_mode="sequence-mean")
    with pytest.raises(ValueError, match="max_response_length"):
        GRPOLoss(loss_agg_mode="seq-mean-token-sum-norm")
    logprobs, old, adv, mask = _on_policy()
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPOLoss(kl_coef=0.1)(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
    with pytest.raises(ValueError, match="advantages"):
        GRPOLoss()(logprobs, old, adv[:1], mask, num_tokens=3, num_seqs=2)
    with pytest.raises(ValueError, match="mask"):
        GRPOLoss()(logprobs, old, adv, mask[:, :2], num_tokens=3, num_seqs=2)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_empty_rows_and_garbage_padding_stay_finite(mode):
    # Row 1 has no response tokens, and padding holds -inf / NaN: nothing may leak into loss or grad.
    logprobs = torch.tensor([[-1.0, float("-inf")], [float("nan"), float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("nan")], [float("-inf"), 0.0]])
    ref = torch.tensor([[-1.0, float("inf")], [float("nan"), float("nan")]])
    mask = torch.tensor([[True, False], [False, False]])
    loss_fn = GRPOLoss(kl_coef=0.1, loss_agg_mode=mode, max_response_length=2)
    out = loss_fn(logprobs, old, torch.tensor([1.0, 1.0]), mask, ref_logprobs=ref, num_tokens=1, num_seqs=2)
    out.loss.backward()
    assert all(torch.isfinite(v).all() for v in out)
    assert torch.isfinite(logprobs.grad).all()
    # Every row empty and global counts of 0: still finite (0, not 0/0).
    out = loss_fn(
        logprobs.detach(), old, torch.ones(2), torch.zeros(2, 2, dtype=torch.bool),
        ref_logprobs=ref, num_tokens=0, num_seqs=0,
    )
    assert [v.item() for v in out] == [0.0, 0.0, 0.0, 0.0, 0.0]


def _random_batch(seed=0):
    # 8 sequences, T = 6, response lengths [5, 1, 0, 3, 6, 2, 4, 6] (one empty row).
    g = torch.Generator().manual_seed(seed)
    b, t = 8, 6
    lengths = torch.tensor([5, 1, 0, 3, 6, 2, 4, 6])
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)  # [8, 6]
    logprobs = -torch.rand(b, t, generator=g) * 3
    # old/ref within +-0.4 nats, so some ratios fall outside [0.8, 1.28] and get clipped
    old = logprobs + (torch.rand(b, t, generator=g) - 0.5) * 0.8
    ref = logprobs + (torch.rand(b, t, generator=g) - 0.5) * 0.8
    adv = torch.randn(b, generator=g)
    return logprobs, old, ref, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("counts_as_tensors", [False, True])
def test_micro_batches_sum_to_full_batch(mode, counts_as_tensors):
    logprobs, old, ref, adv, mask = _random_batch()
    loss_fn = GRPOLoss(epsilon=0.2, epsilon_high=0.28, kl_coef=0.05, loss_agg_mode=mode, max_response_length=6)
    num_tokens, num_seqs = int(mask.sum()), mask.shape[0]  # 27 tokens, 8 sequences
    if counts_as_tensors:
        num_tokens, num_seqs = torch.tensor(num_tokens), torch.tensor(num_seqs)

    full_lp = logprobs.clone().requires_grad_(True)
    full = loss_fn(full_lp, old, adv, mask, ref_logprobs=ref, num_tokens=num_tokens, num_seqs=num_seqs)
    full.loss.backward()
    assert 0 < full.clip_fraction.item() < 1  # the case exercises both branches

    micro_lp = logprobs.clone().requires_grad_(True)
    totals = [torch.zeros(()) for _ in LossOutput._fields]
    for s in range(0, 8, 2):  # 4 micro-batches of 2, each divided by the global counts
        sl = slice(s, s + 2)
        out = loss_fn(
            micro_lp[sl], old[sl], adv[sl], mask[sl], ref_logprobs=ref[sl], num_tokens=num_tokens, num_seqs=num_seqs
        )
        out.loss.backward()
        totals = [a + v.detach() for a, v in zip(totals, out)]
    for name, total, whole in zip(LossOutput._fields, totals, full):
        torch.testing.assert_close(total, whole.detach(), atol=1e-6, rtol=0, msg=f"{mode}: {name}")
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, atol=1e-6, rtol=0)


def test_seq_mean_token_mean_matches_explicit_formula():
    # GRPO's original objective written out: (1/num_seqs) sum_i (1/|o_i|) sum_t loss_it, empty rows adding 0.
    logprobs, old, ref, adv, mask = _random_batch(seed=1)
    loss_fn = GRPOLoss(loss_agg_mode="seq-mean-token-mean")
    out = loss_fn(logprobs, old, adv, mask, num_tokens=int(mask.sum()), num_seqs=8)
    token_loss = GRPOLoss(loss_agg_mode="token-mean")
    expected = 0.0
    for i in range(8):
        n_i = int(mask[i].sum())
        if n_i:
            # token-mean over row i alone is that row's mean token loss
            expected += token_loss(logprobs[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                                   num_tokens=n_i, num_seqs=1).loss.item()
    assert out.loss.item() == pytest.approx(expected / 8, abs=1e-6)
