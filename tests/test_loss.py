"""GRPOLoss: hand-computed values and gradients of every mode, clip, KL estimator and bonus, and
independence of how the global batch is split (micro-batches, processes)."""

import math

import pytest
import torch

from torchtune_grpo.loss import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    CISPOLoss,
    GMPOLoss,
    GRPOLoss,
    LossOutput,
    SAPOLoss,
    kl_estimate,
    kl_reward_penalty,
)

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
    # Ratio exp(0) = 1 and the sums of +-1, 0.5 are exact in fp32; only "/ 3" rounds (half an ulp of 0.5: 3e-8),
    # whatever the kernel. Bound: 1e-7 (~2 ulp at 0.5); ratio_mean 3 / 3 is exact (approx's default 1e-6 relative).
    assert out.loss.item() == pytest.approx(expected, abs=1e-7)
    assert out.policy_loss.item() == pytest.approx(expected, abs=1e-7)
    assert out.kl.item() == 0.0  # kl_coef 0 and no ref: metric is 0
    assert out.clip_fraction.item() == 0.0
    assert out.ratio_mean.item() == pytest.approx(1.0)  # 3 tokens of ratio 1 / 3
    assert out.entropy.item() == 0.0  # no entropy given
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
    # rho = exp(old + log r - old): log, add, subtract, exp each round (the vectorised and scalar exp/log differ by
    # under 1 ulp), ~3 ulp at rho <= 1.5 (1 ulp = 1.2e-7): <= 4e-7 per token; the token-mean of 5 keeps that, plus
    # one rounding. Bound: 1e-6 for loss and ratio_mean; clip_fraction 2 / 5 is one rounding (approx's 1e-6 rel).
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
    # Same computation as above (<= 4e-7 per token through log/exp, one rounding for / 5). Bound: 1e-6.
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
    # ref = logp + ln2 rounds once (ulp 6e-8 at |ref| < 1), then d, exp(d) - d - 1 a few roundings at ~0.3-2
    # (ulp <= 2.4e-7 at 2, cancelling to 0.3): k3 within ~5e-7 worst case, token-mean of 2 and x 0.1 one rounding
    # each. Bound: 1e-6 for kl, 1e-7 for the loss (x 0.1: ~5e-8 worst case).
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
    # As in test_k3_kl_value_and_gradient: k3 from a few roundings at magnitude <= 2, <= 5e-7. Bound: 1e-6.
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
    assert [v.item() for v in out] == [0.0] * len(LossOutput._fields)


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


# Every aggregation mode, plus the other knobs, each on top of clip-higher and a k3 KL term.
SPLIT_VARIANTS = [{"loss_agg_mode": m} for m in LOSS_AGG_MODES] + [
    {"loss_agg_mode": "seq-mean-token-mean", "ratio_level": "sequence", "epsilon": 0.02, "epsilon_high": 0.03},
    {"loss_agg_mode": "token-mean", "ratio_level": "sequence", "epsilon": 0.02},
    {"loss_agg_mode": "seq-mean-token-sum-norm", "dual_clip": 1.1, "entropy_coef": 0.01},
] + [{"loss_agg_mode": "seq-mean-token-mean", "kl_estimator": k} for k in KL_ESTIMATORS]
# CISPO, GMPO and SAPO in every aggregation mode (on top of the k3 KL term), then with TIS, rollout-correction
# weights (``_weights``), the other KL estimators and an entropy bonus. ``_class`` picks the loss.
SPLIT_VARIANTS += [
    {"_class": cls, "loss_agg_mode": m, **extra}
    for cls, extra in ((CISPOLoss, {"epsilon_low": 0.2}), (GMPOLoss, {"epsilon": 0.2}), (SAPOLoss, {}))
    for m in LOSS_AGG_MODES
] + [
    {"_class": CISPOLoss, "loss_agg_mode": "token-mean", "tis_cap": 1.1, "_weights": True, "kl_estimator": "k2"},
    {"_class": GMPOLoss, "loss_agg_mode": "seq-mean-token-mean", "epsilon": 0.1, "tis_cap": 1.1, "_weights": True,
     "kl_estimator": "k3+", "entropy_coef": 0.01},
    {"_class": SAPOLoss, "loss_agg_mode": "seq-mean-token-sum-norm", "tis_cap": 1.1, "_weights": True,
     "kl_estimator": "k1", "tau_neg": 3.0},
    {"loss_agg_mode": "token-mean", "tis_cap": 1.1, "_weights": True},
]


def _split_id(v):
    return "-".join(f"{k}={getattr(x, '__name__', x)}" for k, x in v.items())


@pytest.mark.parametrize("variant", SPLIT_VARIANTS, ids=_split_id)
@pytest.mark.parametrize("counts_as_tensors", [False, True])
def test_micro_batches_and_processes_sum_to_full_batch(variant, counts_as_tensors):
    # The recipe's contract: each micro-batch is divided by the *global* counts, micro-batch losses are
    # summed (gradient accumulation) and ranks' gradients summed (FSDP averages, the recipe scales by the
    # world size). So 1 process x 1 micro-batch, 1 x 4 and 2 processes x 2 must give the same loss and
    # gradient. A process split is a split of rows like a micro-batch split: simulated here as 2 "ranks"
    # of 4 rows with 2 micro-batches each, whose results are summed.
    logprobs, old, ref, adv, mask = _random_batch()
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(logprobs.shape, generator=g) * 5
    # the engine's logprobs (TIS) and rollout-correction weights, both constants per token
    sampler = old + (torch.rand(logprobs.shape, generator=g) - 0.5) * 0.4
    weights = torch.rand(logprobs.shape, generator=g) * 2
    variant = dict(variant)
    cls = variant.pop("_class", GRPOLoss)
    with_weights = variant.pop("_weights", False)
    clip = {"epsilon": 0.2, "epsilon_high": 0.28} if cls is GRPOLoss else {}
    loss_fn = cls(**{**clip, "kl_coef": 0.05, "max_response_length": 6, **variant})
    num_tokens, num_seqs = int(mask.sum()), mask.shape[0]  # 27 tokens, 8 sequences
    if counts_as_tensors:
        num_tokens, num_seqs = torch.tensor(num_tokens), torch.tensor(num_seqs)

    def run(splits):
        lp = logprobs.clone().requires_grad_(True)
        ent = entropy.clone().requires_grad_(True)
        totals = [torch.zeros(()) for _ in LossOutput._fields]
        for rank_rows in splits:  # one list of micro-batch slices per rank
            for sl in rank_rows:
                out = loss_fn(
                    lp[sl], old[sl], adv[sl], mask[sl], ref_logprobs=ref[sl], entropy=ent[sl],
                    num_tokens=num_tokens, num_seqs=num_seqs, sampler_logprobs=sampler[sl],
                    importance_weights=weights[sl] if with_weights else None,
                )
                out.loss.backward()
                totals = [a + v.detach() for a, v in zip(totals, out)]
        return totals, lp.grad, ent.grad

    full, full_grad, full_ent_grad = run([[slice(0, 8)]])
    if cls is not SAPOLoss:  # SAPO has no hard clip
        assert 0 < full[LossOutput._fields.index("clip_fraction")].item() < 1  # both branches exercised
    for splits in (
        [[slice(s, s + 2) for s in range(0, 8, 2)]],  # 1 process, 4 micro-batches
        [[slice(0, 2), slice(2, 4)], [slice(4, 6), slice(6, 8)]],  # 2 processes, 2 micro-batches each
    ):
        totals, grad, ent_grad = run(splits)
        # Each field is a sum of per-token terms divided by the global counts: one sum of the 27 tokens (or 8 rows)
        # against 4 micro-batch sums added up. Regrouping a sum of n terms moves it by ~sqrt(n) / 2 ulp of its partial
        # sums typically (tests/tolerances.py: ~3 ulp here), the elementwise terms themselves being the same values (row
        # by row). The fields are <~ 3 (entropy <= 5 x 0.01 bonus, ratios, k3; 1 ulp <= 2.4e-7), the gradients <~ 0.4 (1
        # ulp 3e-8). Bound: 1e-6, >= 4 ulp of the largest field (measured: 2.4e-7, 1 ulp at 1.9, with AVX-512, AVX2 and
        # scalar kernels).
        for name, total, whole in zip(LossOutput._fields, totals, full):
            torch.testing.assert_close(total, whole, atol=1e-6, rtol=0, msg=f"{variant}: {name}")
        torch.testing.assert_close(grad, full_grad, atol=1e-6, rtol=0)
        torch.testing.assert_close(ent_grad, full_ent_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", SPLIT_VARIANTS, ids=_split_id)
def test_mini_batches_use_their_own_global_counts(variant):
    # ppo_mini_batches: 2 on 2 processes. Rows are groups of 2 ({0,1}, {2,3}, ...); rank 0 holds rows 0-3 and
    # rank 1 rows 4-7, and mini-batch m takes group m of each rank: mini-batch 0 = rows {0, 1, 4, 5}. Its loss
    # is divided by *its* global counts (rows 0, 1, 4, 5 have 5 + 1 + 6 + 2 = 14 tokens, 4 sequences), and
    # each rank's micro-batches (one row each here) with those counts sum to the loss of the mini-batch as one
    # batch, in value and gradient.
    logprobs, old, ref, adv, mask = _random_batch()
    g = torch.Generator().manual_seed(4)
    entropy = torch.rand(logprobs.shape, generator=g) * 5
    sampler = old + (torch.rand(logprobs.shape, generator=g) - 0.5) * 0.4
    weights = torch.rand(logprobs.shape, generator=g) * 2
    variant = dict(variant)
    cls = variant.pop("_class", GRPOLoss)
    with_weights = variant.pop("_weights", False)
    clip = {"epsilon": 0.2, "epsilon_high": 0.28} if cls is GRPOLoss else {}
    loss_fn = cls(**{**clip, "kl_coef": 0.05, "max_response_length": 6, **variant})
    for rows in ([0, 1, 4, 5], [2, 3, 6, 7]):
        idx = torch.tensor(rows)
        num_tokens, num_seqs = int(mask[idx].sum()), len(rows)
        if rows[0] == 0:
            assert num_tokens == 14
        lp = logprobs.clone().requires_grad_(True)

        def loss(sub, lp=lp, num_tokens=num_tokens, num_seqs=num_seqs):
            return loss_fn(
                lp[sub], old[sub], adv[sub], mask[sub], ref_logprobs=ref[sub], entropy=entropy[sub],
                num_tokens=num_tokens, num_seqs=num_seqs, sampler_logprobs=sampler[sub],
                importance_weights=weights[sub] if with_weights else None,
            )

        whole = loss(idx)
        (whole_grad,) = torch.autograd.grad(whole.loss, lp)
        parts = [loss(torch.tensor([r])) for r in rows]  # 2 ranks x 2 micro-batches of one row
        total = sum(p.loss for p in parts)
        (grad,) = torch.autograd.grad(total, lp)
        # As in test_micro_batches_and_processes_sum_to_full_batch: the same per-token terms, 4 one-row sums added up
        # against one sum over the mini-batch's 14 tokens (~2 ulp of fields <~ 3 typically). Bound: 1e-6 (measured:
        # 2.4e-7, 1 ulp at 2.97, with AVX-512, AVX2 and scalar kernels).
        torch.testing.assert_close(total, whole.loss, atol=1e-6, rtol=0, msg=str(variant))
        torch.testing.assert_close(grad, whole_grad, atol=1e-6, rtol=0)
        for name in ("kl", "clip_fraction", "ratio_mean", "entropy"):
            torch.testing.assert_close(sum(getattr(p, name) for p in parts), getattr(whole, name), atol=1e-6, rtol=0)
        other = [r for r in range(8) if r not in rows]
        assert whole_grad[other].abs().max() == 0  # the other mini-batch's rows are not in this step


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
    # The same per-token fp32 terms (|loss| <= ~4: ratio <= 1.5 times |A| <= ~2.5), summed per row and divided by
    # its length in both; only the order of the final mean differs (fp32 in the loss, float64 here over fp32 row
    # results): <= 8 roundings at magnitude <= 1 (ulp 1.2e-7), ~5e-7 worst case. Bound: 1e-6.
    assert out.loss.item() == pytest.approx(expected / 8, abs=1e-6)


# ---------------------------------------------------------------------------------------- KL estimators

# d = log pi_ref - log pi = [ln 2, -ln 2] on two tokens (pi_ref / pi = [2, 1/2]); by hand:
#   k1 = -d                = [-ln2, ln2]                       = [-0.693147, 0.693147]
#   k2 = d^2 / 2           = [ln2^2 / 2] * 2                    = [0.240227, 0.240227]
#   k3 = exp(d) - d - 1    = [2 - ln2 - 1, 0.5 + ln2 - 1]       = [0.306853, 0.193147]
#   k3+ = k3 in value
# Gradients wrt log pi (dd/dlogp = -1):
#   k1: 1;  k2: -d = [-ln2, ln2];  k3: 1 - exp(d) = [-1, 0.5];  k3+: k2's = [-ln2, ln2]
LN2_SQ_HALF = LN2 * LN2 / 2
KL_CASES = {
    "k1": ([-LN2, LN2], [1.0, 1.0]),
    "k2": ([LN2_SQ_HALF, LN2_SQ_HALF], [-LN2, LN2]),
    "k3": ([1 - LN2, LN2 - 0.5], [-1.0, 0.5]),
    "k3+": ([1 - LN2, LN2 - 0.5], [-LN2, LN2]),
}


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimator_values_and_gradients(estimator):
    values, grads = KL_CASES[estimator]
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = logprobs.detach() + torch.tensor([[LN2, -LN2]])
    kl = kl_estimate(logprobs, ref, estimator)
    torch.testing.assert_close(kl, torch.tensor([values]))
    kl.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([grads]))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimator_in_the_loss(estimator):
    # A = 0 and on-policy: the loss is kl_coef x token-mean KL; gradient kl_coef / num_tokens x the above.
    values, grads = KL_CASES[estimator]
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = logprobs.detach() + torch.tensor([[LN2, -LN2]])
    out = GRPOLoss(kl_coef=0.1, kl_estimator=estimator)(
        logprobs, logprobs.detach(), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool),
        ref_logprobs=ref, num_tokens=2, num_seqs=1,
    )
    # Each estimator is a few fp32 roundings (ref = logp + ln2, d, exp/square) at magnitude <= 2 (ulp <= 2.4e-7),
    # <= 5e-7 worst case; the mean of 2 and x 0.1 one rounding each. Bound: 1e-6 for kl, 1e-7 for 0.1 x kl.
    assert out.kl.item() == pytest.approx(sum(values) / 2, abs=1e-6)
    assert out.loss.item() == pytest.approx(0.1 * sum(values) / 2, abs=1e-7)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, 0.05 * torch.tensor([grads]))


def test_kl_estimate_masks_garbage():
    # Masked positions are exactly 0, even with inf/NaN inputs there, and give no NaN gradient.
    logprobs = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    ref = torch.tensor([[-1.0 + LN2, float("inf")]])
    kl = kl_estimate(logprobs, ref, "k3", mask=torch.tensor([[True, False]]))
    torch.testing.assert_close(kl, torch.tensor([[1 - LN2, 0.0]]))
    kl.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, 0.0]]))


def test_kl_reward_penalty_by_hand():
    # Seq 0: d = [ln2, -ln2] -> k1 sum = 0, k3 sum = 0.5; seq 1: one token, d = ln2 (second token masked):
    #   k1 = -ln2, k3 = 1 - ln2. Penalty = kl_coef (0.1) x per-sequence sum.
    logprobs = torch.tensor([[-1.0, -2.0], [-1.0, 5.0]])
    ref = logprobs + torch.tensor([[LN2, -LN2], [LN2, 3.0]])
    mask = torch.tensor([[True, True], [True, False]])
    k1 = kl_reward_penalty(logprobs, ref, mask, kl_coef=0.1, estimator="k1")
    torch.testing.assert_close(k1, torch.tensor([0.0, -0.1 * LN2]))
    k3 = kl_reward_penalty(logprobs, ref, mask, kl_coef=0.1, estimator="k3")
    torch.testing.assert_close(k3, torch.tensor([0.05, 0.1 * (1 - LN2)]))
    assert not k3.requires_grad


# ----------------------------------------------------------------------------- clipping variants


def test_epsilon_low_separate_from_epsilon_high():
    # A = -1, ratio 0.85. eps_low 0.1: clip range [0.9, 1.2]: -min(-0.85, -0.9) = 0.9 (clipped, no grad).
    # eps_low 0.2 (= epsilon): 0.85 is inside [0.8, 1.2]: loss 0.85, gradient -A rho = 0.85.
    old = torch.tensor([[-1.0]])
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool)
    for eps_low, value, grad, clipped in ((0.1, 0.9, 0.0, 1.0), (None, 0.85, 0.85, 0.0)):
        logprobs = (old + math.log(0.85)).requires_grad_(True)
        out = GRPOLoss(epsilon=0.2, epsilon_low=eps_low)(logprobs, old, adv, mask, num_tokens=1, num_seqs=1)
        # rho = exp(old + log 0.85 - old): ~3 roundings at ~1 (1.2e-7 each, exp/log kernels within 1 ulp); loss and
        # gradient are rho or a constant, one more rounding. Bound: 1e-6 (~8 ulp).
        assert out.loss.item() == pytest.approx(value, abs=1e-6)
        assert out.clip_fraction.item() == clipped
        out.loss.backward()
        assert logprobs.grad.item() == pytest.approx(grad, abs=1e-6)


def test_dual_clip_bounds_negative_advantages():
    # A = -1, eps 0.2, ratios [4, 2, 0.5], token-mean over 3 tokens:
    #   rho 4:   -min(-4, -1.2) = 4   -> dual clip c = 3: min(4, 3) = 3   (no gradient)
    #   rho 2:   -min(-2, -1.2) = 2   -> min(2, 3) = 2                    (gradient -A rho = 2)
    #   rho 0.5: -min(-0.5, -0.8) = 0.8 (lower clip, no gradient)
    # loss (3 + 2 + 0.8) / 3 = 1.933333; gradient [0, 2/3, 0]; 2 of 3 tokens clipped.
    # Without dual clip: (4 + 2 + 0.8) / 3 = 2.266667, gradient [4/3, 2/3, 0].
    old = torch.full((1, 3), -1.0)
    adv, mask = torch.tensor([-1.0]), torch.ones(1, 3, dtype=torch.bool)
    ratios = torch.tensor([[4.0, 2.0, 0.5]])
    for dual, value, grad, clipped in (
        (3.0, 5.8 / 3, [0.0, 2 / 3, 0.0], 2 / 3),
        (None, 6.8 / 3, [4 / 3, 2 / 3, 0.0], 1 / 3),
    ):
        logprobs = (old + ratios.log()).requires_grad_(True)
        out = GRPOLoss(epsilon=0.2, dual_clip=dual)(logprobs, old, adv, mask, num_tokens=3, num_seqs=1)
        # rho = exp(old + log r - old) for r up to 4 (ulp 4.8e-7 at 4): ~3 roundings, but the clipped tokens give the
        # exact constants 3 / 0.8 and the unclipped one rho = 2 (ulp 2.4e-7): the mean of 3 is within ~5e-7.
        # Bound: 1e-6; clip_fraction 2/3, 1/3 one rounding (approx's 1e-6 relative); the gradient 2/3 rho / 3 with
        # assert_close's fp32 default (1e-5 abs + 1.3e-6 rel).
        assert out.loss.item() == pytest.approx(value, abs=1e-6)
        assert out.clip_fraction.item() == pytest.approx(clipped)
        out.loss.backward()
        torch.testing.assert_close(logprobs.grad, torch.tensor([grad]))


def test_dual_clip_leaves_positive_advantages_alone():
    # A = +1, rho 4, eps_high large (10): -min(4, 4) = -4 with or without dual clip 3.
    old = torch.tensor([[-1.0]])
    logprobs = old + math.log(4.0)
    out = GRPOLoss(epsilon=0.2, epsilon_high=10.0, dual_clip=3.0)(
        logprobs, old, torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool), num_tokens=1, num_seqs=1
    )
    # rho = exp(old + log 4 - old) = 4 to ~3 roundings at 4 (ulp 4.8e-7): ~1.5e-6 worst case. Bound: 1e-5 (~20 ulp).
    assert out.loss.item() == pytest.approx(-4.0, abs=1e-5)


def _gspo_batch():
    # Seq 0 (A = +1): two tokens with log ratios [ln 2, 0] -> s_0 = exp(ln2 / 2) = sqrt(2) = 1.414214.
    # Seq 1 (A = -1): one token (second is padding) with log ratio ln 0.5 -> s_1 = 0.5.
    old = torch.full((2, 2), -1.0)
    log_ratios = torch.tensor([[LN2, 0.0], [-LN2, 7.0]])
    logprobs = (old + log_ratios).requires_grad_(True)
    mask = torch.tensor([[True, True], [True, False]])
    return logprobs, old, torch.tensor([1.0, -1.0]), mask


def test_gspo_sequence_ratio_values_and_gradients():
    # eps_low 0.2, eps_high 1.0 (so s_0 = 1.414 is inside [0.8, 2.0]):
    #   l_0 = -min(1.414214, 1.414214) = -1.414214 (unclipped): every token of seq 0 carries it
    #   l_1 = -min(-0.5, -0.8) = 0.8 (clipped below: no gradient)
    # seq-mean-token-mean = (l_0 + l_1) / 2 = (-1.414214 + 0.8) / 2 = -0.307107: GSPO's (1/N) sum_i l_i.
    # Gradient: d l_0 / d logp_t = -A s_0 / |o_0| = -1.414214 / 2 per token, / N = 2 -> -0.353553 each.
    # clip_fraction: 1 of 3 tokens; ratio_mean (2 x 1.414214 + 0.5) / 3 = 1.109476.
    logprobs, old, adv, mask = _gspo_batch()
    out = GRPOLoss(ratio_level="sequence", epsilon=0.2, epsilon_high=1.0, loss_agg_mode="seq-mean-token-mean")(
        logprobs, old, adv, mask, num_tokens=3, num_seqs=2
    )
    s0 = math.sqrt(2.0)
    # s_0 = exp(mean of 2 log ratios) and the clip constant 0.8: a few roundings at ~1.4 (ulp 1.2e-7), ~4e-7;
    # the seq-mean of 2 one more. Bound: 1e-6 for loss and ratio_mean; clip_fraction 1/3 one rounding.
    assert out.loss.item() == pytest.approx((-s0 + 0.8) / 2, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)
    assert out.ratio_mean.item() == pytest.approx((2 * s0 + 0.5) / 3, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-s0 / 4, -s0 / 4], [0.0, 0.0]]))


def test_gspo_clips_the_whole_sequence():
    # GSPO's range [1 - 3e-4, 1 + 4e-4]: s_0 = 1.414 > 1.0004 with A > 0 -> clipped, no gradient on any of
    # its tokens, although token 1 alone has ratio 1 (a token-level ratio would keep its gradient).
    logprobs, old, adv, mask = _gspo_batch()
    out = GRPOLoss(ratio_level="sequence", epsilon=3e-4, epsilon_high=4e-4, loss_agg_mode="seq-mean-token-mean")(
        logprobs, old, adv, mask, num_tokens=3, num_seqs=2
    )
    # l_0 = -1.0004, l_1 = -min(-0.5, -0.9997) = 0.9997 -> (-1.0004 + 0.9997) / 2 = -0.00035
    # Clipped: the loss is the constants 1 + 4e-4 and 1 - 3e-4 in fp32 (each rounded once, 6e-8), their difference
    # and halving exact or one rounding: ~1e-7. Bound: 1e-6. The token-level gradient below is -1/2/2 with rho =
    # exp(0) = 1: exact (approx's default relative 1e-6).
    assert out.loss.item() == pytest.approx((-1.0004 + 0.9997) / 2, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(1.0)
    out.loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 2))
    token_level = GRPOLoss(epsilon=3e-4, epsilon_high=4e-4, loss_agg_mode="seq-mean-token-mean")
    lp = logprobs.detach().requires_grad_(True)
    token_level(lp, old, adv, mask, num_tokens=3, num_seqs=2).loss.backward()
    # token 1 of seq 0 (ratio 1, inside the range): -A rho / |o_0| / N = -1 / 2 / 2
    assert lp.grad[0, 1].item() == pytest.approx(-0.25)


def test_entropy_bonus_value_gradient_and_metric():
    # A = 0, on-policy: only the bonus. Entropies [1, 2 | 3, (padding: NaN)], 3 tokens:
    #   metric = (1 + 2 + 3) / 3 = 2; loss = -0.1 x 2 = -0.2 (token-mean);
    #   d loss / d H = -0.1 / 3 on response tokens, 0 on padding.
    logprobs = torch.tensor([[-1.0, -1.0], [-1.0, 0.0]], requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0], [3.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    out = GRPOLoss(entropy_coef=0.1)(
        logprobs, logprobs.detach(), torch.zeros(2), mask, entropy=entropy, num_tokens=3, num_seqs=2
    )
    # (1 + 2 + 3) / 3 is exact; -0.1 x 2 one rounding (fp32 0.1: 1.5e-9 relative). Bounds: approx's 1e-6 relative
    # and 1e-7 absolute.
    assert out.entropy.item() == pytest.approx(2.0)
    assert out.loss.item() == pytest.approx(-0.2, abs=1e-7)
    out.loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1 / 3, -0.1 / 3], [-0.1 / 3, 0.0]]))
    # Without the bonus the entropy is only reported: no gradient reaches it.
    entropy.grad = None
    out = GRPOLoss()(logprobs, logprobs.detach(), torch.zeros(2), mask, entropy=entropy, num_tokens=3, num_seqs=2)
    assert out.entropy.item() == pytest.approx(2.0) and out.loss.item() == 0.0
    assert not out.loss.requires_grad or torch.autograd.grad(out.loss, entropy, allow_unused=True)[0] is None


def test_new_argument_errors():
    with pytest.raises(ValueError, match="kl_estimator"):
        GRPOLoss(kl_estimator="k4")
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k5")
    with pytest.raises(ValueError, match="ratio_level"):
        GRPOLoss(ratio_level="group")
    with pytest.raises(ValueError, match="dual_clip"):
        GRPOLoss(dual_clip=0.9)
    with pytest.raises(ValueError, match="entropy_coef"):
        GRPOLoss(entropy_coef=-0.1)
    with pytest.raises(ValueError, match="clip ranges"):
        GRPOLoss(epsilon_low=-0.1)
    logprobs, old, adv, mask = _on_policy()
    with pytest.raises(ValueError, match="entropy"):
        GRPOLoss(entropy_coef=0.1)(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
