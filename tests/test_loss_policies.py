"""CISPO, GMPO and SAPO: values and gradients worked out by hand, the on-policy gradient they share with GRPO,
and errors. Split independence of each is in tests/test_loss.py (SPLIT_VARIANTS)."""

import math

import pytest
import torch

from torchtune_grpo.loss import LOSS_AGG_MODES, CISPOLoss, GMPOLoss, GRPOLoss, SAPOLoss

LN2 = math.log(2.0)


def _off_policy():
    # old_logprobs = -1 on every token, so log pi = -1 + log r. Ratios:
    #   seq 0, A = +1: [1.5, 0.5, 1.1]
    #   seq 1, A = -1: [0.5, 1.5, (padding)]
    ratios = torch.tensor([[1.5, 0.5, 1.1], [0.5, 1.5, 1.0]])
    old = torch.full((2, 3), -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logprobs, old, torch.tensor([1.0, -1.0]), mask


# ------------------------------------------------------------------------------------------------ CISPO


def test_cispo_values_and_gradients():
    # eps_high 0.28, no lower bound: weights w = sg(clip(r, 0, 1.28)) = [1.28, 0.5, 1.1 | 0.5, 1.28].
    # log pi = -1 + ln r: [-0.594535, -1.693147, -0.904690 | -1.693147, -0.594535].
    # p = -w A log pi:
    #   seq 0 (A = +1): [1.28 * 0.594535, 0.5 * 1.693147, 1.1 * 0.904690] = [0.761005, 0.846574, 0.995159]
    #   seq 1 (A = -1): [0.5 * -1.693147, 1.28 * -0.594535]              = [-0.846574, -0.761005]
    # sum = 0.995159; token-mean over 5 tokens = 0.199032.
    # Gradient -w A / 5 on every token, the clipped ones included (PPO would give 0 at (0,0) and (1,0)):
    #   [[-1.28, -0.5, -1.1], [0.5, 1.28, 0]] / 5
    # clip_fraction: ratios 1.5 > 1.28 at (0,0) and (1,1): 2 / 5.
    logprobs, old, adv, mask = _off_policy()
    out = CISPOLoss(epsilon_high=0.28)(logprobs, old, adv, mask, num_tokens=5, num_seqs=2)
    log_pi = [-1 + math.log(r) for r in (1.5, 0.5, 1.1)]
    expected = -(1.28 * log_pi[0] + 0.5 * log_pi[1] + 1.1 * log_pi[2]) + (0.5 * log_pi[1] + 1.28 * log_pi[0])
    # ``expected`` is float64 arithmetic against the 6-digit hand value above (rounded to 5e-7): 1e-6. The loss
    # sums 5 fp32 terms w log pi, each ~3 roundings (log, add, multiply) at magnitude <= 1.7 (ulp 1.2e-7 at 1-2),
    # cancelling to ~1: ~5e-7 worst case before the / 5. Bound: 1e-6 for the loss and the ratio mean (5 ratios
    # exp(old + log r - old) ~3 ulp each at <= 1.5, one rounding for / 5); 2/5 and 4/5 are one rounding (approx's
    # default 1e-6 relative).
    assert expected == pytest.approx(0.995159, abs=1e-6)
    assert out.loss.item() == pytest.approx(expected / 5, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(0.4)
    assert out.ratio_mean.item() == pytest.approx(5.1 / 5, abs=1e-6)  # unclipped r
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.28, -0.5, -1.1], [0.5, 1.28, 0.0]]) / 5)


def test_cispo_lower_bound():
    # epsilon_low 0.2: the r = 0.5 tokens get weight 0.8; gradient [[-1.28, -0.8, -1.1], [0.8, 1.28, 0]] / 5,
    # and 4 of 5 tokens are clipped.
    logprobs, old, adv, mask = _off_policy()
    out = CISPOLoss(epsilon_high=0.28, epsilon_low=0.2)(logprobs, old, adv, mask, num_tokens=5, num_seqs=2)
    assert out.clip_fraction.item() == pytest.approx(0.8)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.28, -0.8, -1.1], [0.8, 1.28, 0.0]]) / 5)


# ------------------------------------------------------------------------------------------------- GMPO


def _two_sequences():
    # Seq 0 (A = +1): log ratios [ln 2, 0]; seq 1 (A = -1): one token (then padding) with log ratio -ln 2.
    old = torch.full((2, 2), -1.0)
    logprobs = (old + torch.tensor([[LN2, 0.0], [-LN2, 7.0]])).requires_grad_(True)
    mask = torch.tensor([[True, True], [True, False]])
    return logprobs, old, torch.tensor([1.0, -1.0]), mask


def test_gmpo_clips_in_log_space():
    # epsilon 0.4: seq 0 (A > 0) clips log r above 0.4: [min(0.693147, 0.4), 0] = [0.4, 0] -> mean 0.2,
    #   s_0 = e^0.2 = 1.221403, p_0 = -A s_0 = -1.221403 on both tokens.
    # seq 1 (A < 0) clips below -0.4: max(-0.693147, -0.4) = -0.4, s_1 = e^-0.4 = 0.670320, p_1 = +0.670320.
    # seq-mean-token-mean = (p_0 + p_1) / 2 = (-1.221403 + 0.670320) / 2 = -0.275541  (GMPO's (1/N) sum_i p_i)
    # Gradient: clipped tokens (0,0) and (1,0) get 0; token (0,1): dp_0/dx = -A s_0 / |o_0| = -1.221403 / 2,
    #   / N = 2 -> -0.305351. clip_fraction 2 / 3; ratio_mean (2 s_0 + s_1) / 3.
    logprobs, old, adv, mask = _two_sequences()
    out = GMPOLoss(epsilon=0.4, loss_agg_mode="seq-mean-token-mean")(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
    s0, s1 = math.exp(0.2), math.exp(-0.4)
    # The clipped log ratios are the fp32 constants +-0.4 (rounded once); the mean, exp and halving a few roundings at
    # ~1.2 (ulp 1.2e-7): ~4e-7 worst case against the float64 reference. Bound: 1e-6; 2/3 one rounding.
    assert out.loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(2 / 3)
    assert out.ratio_mean.item() == pytest.approx((2 * s0 + s1) / 3, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -s0 / 4], [0.0, 0.0]]))


def test_gmpo_unclipped_and_token_mean():
    # epsilon 1.0: nothing clipped. s_0 = exp(ln2 / 2) = sqrt(2), s_1 = 0.5; p_0 = -sqrt(2), p_1 = 0.5.
    # token-mean weighs each sequence by its length: (2 p_0 + p_1) / 3 = (-2.828427 + 0.5) / 3 = -0.776142.
    # Gradient of token t of seq 0: 2 tokens carry p_0, each d p_0 / dx_t = -sqrt(2) / 2 -> 2 * (-0.707107) / 3
    #   = -0.471405; seq 1: d p_1 / dx = -A s_1 = 0.5 -> 0.5 / 3 = 0.166667.
    logprobs, old, adv, mask = _two_sequences()
    out = GMPOLoss(epsilon=1.0)(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
    r2 = math.sqrt(2.0)
    # log ratios ln 2 (old + ln 2 - old, ~2 roundings at 1), mean, exp, sum and / 3: ~5 roundings at <= 2.8 (ulp
    # 2.4e-7), ~6e-7 worst case before the / 3. Bound: 1e-6.
    assert out.loss.item() == pytest.approx((-2 * r2 + 0.5) / 3, abs=1e-6)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-r2 / 3, -r2 / 3], [0.5 / 3, 0.0]]))


def test_gmpo_separate_bounds():
    # epsilon_high 0.8 leaves seq 0 unclipped (ln 2 < 0.8), epsilon_low 0.5 clips seq 1 at -0.5:
    # s_0 = sqrt(2), s_1 = e^-0.5; seq-mean-token-mean = (-sqrt(2) + e^-0.5) / 2.
    logprobs, old, adv, mask = _two_sequences()
    loss = GMPOLoss(epsilon_high=0.8, epsilon_low=0.5, loss_agg_mode="seq-mean-token-mean")
    out = loss(logprobs, old, adv, mask, num_tokens=3, num_seqs=2)
    # As above: a few roundings of log ratios, exp and a mean at ~1.4 (ulp 1.2e-7), ~4e-7. Bound: 1e-6; 1/3 one
    # rounding.
    assert out.loss.item() == pytest.approx((-math.sqrt(2.0) + math.exp(-0.5)) / 2, abs=1e-6)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------------------------- SAPO


def test_sapo_soft_gate_values_and_gradients():
    # tau_pos 1, tau_neg 2; f(r) = (4 / tau) sigmoid(tau (r - 1)), p = -f A, d p / d log pi = -A 4 s (1 - s) r
    # with s = sigmoid(tau (r - 1)):
    #   seq 0 (A = +1, tau 1), r = 1: f = 4 * 0.5 = 2 -> p = -2; gradient -4 * 0.25 * 1 = -1
    #                          r = 2: s = sigmoid(1) = 0.731059, f = 2.924234 -> p = -2.924234;
    #                                 gradient -4 * 0.731059 * 0.268941 * 2 = -1.572895
    #   seq 1 (A = -1, tau 2), r = 0.5: s = sigmoid(-1) = 0.268941, f = 2 * 0.268941 = 0.537883 -> p = 0.537883;
    #                                 gradient +4 * 0.268941 * 0.731059 * 0.5 = 0.393224
    # token-mean over 3: (-2 - 2.924234 + 0.537883) / 3 = -1.462117; gradients / 3. No hard clip.
    old = torch.full((2, 2), -1.0)
    logprobs = (old + torch.tensor([[0.0, LN2], [-LN2, 0.0]])).requires_grad_(True)
    mask = torch.tensor([[True, True], [True, False]])
    out = SAPOLoss(tau_pos=1.0, tau_neg=2.0)(logprobs, old, torch.tensor([1.0, -1.0]), mask, num_tokens=3, num_seqs=2)
    sig1 = 1 / (1 + math.exp(-1.0))
    # r from exp(old + ln 2 - old) (~3 ulp at 2), a sigmoid (the vectorised and scalar kernels within ~1-2 ulp), x 4 /
    # tau: ~5 roundings at <= 3 (ulp 2.4e-7) per token, the sum of 3 at ~4.4 then / 3: ~8e-7 worst case.
    # Bound: 1e-6 (the typical error, sqrt of the roundings, is ~3e-7).
    assert out.loss.item() == pytest.approx((-2 - 4 * sig1 + 2 * (1 - sig1)) / 3, abs=1e-6)
    assert out.clip_fraction.item() == 0.0
    out.loss.backward()
    g = 4 * sig1 * (1 - sig1)  # 0.786448
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -2 * g], [0.5 * g, 0.0]]) / 3)


def test_sapo_gate_decays_faster_for_negative_advantages():
    # Same |A| and ratio 1.5: the gradient weight 4 s (1 - s) r is smaller with the larger temperature.
    #   tau 1:    s = sigmoid(0.5) = 0.622459 -> 4 * 0.622459 * 0.377541 * 1.5 = 1.409963
    #   tau 1.05: s = sigmoid(0.525) = 0.628318 -> 4 * 0.628318 * 0.371682 * 1.5 = 1.401229
    old = torch.full((2, 1), -1.0)
    logprobs = (old + math.log(1.5)).requires_grad_(True)
    out = SAPOLoss()(logprobs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 1, dtype=torch.bool),
                     num_tokens=2, num_seqs=2)
    out.loss.backward()
    s_pos, s_neg = 1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(-0.525))
    expected = torch.tensor([[-4 * s_pos * (1 - s_pos) * 1.5], [4 * s_neg * (1 - s_neg) * 1.5]]) / 2
    torch.testing.assert_close(logprobs.grad, expected)
    assert abs(logprobs.grad[1].item()) < abs(logprobs.grad[0].item())


# -------------------------------------------------------------------------------- shared properties


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("cls", [CISPOLoss, GMPOLoss, SAPOLoss])
def test_on_policy_gradient_equals_grpo(cls, mode):
    # On-policy (r = 1) every one of these losses has GRPO's gradient -A grad log pi per token (CISPO: weight
    # 1; GMPO: each of the |o_i| tokens of p_i = -A_i exp(mean x) gets -A_i / |o_i| from the |o_i| copies;
    # SAPO: 4 sigma(0) (1 - sigma(0)) = 1), whatever the aggregation mode.
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 1, 0, 4])
    mask = torch.arange(4).unsqueeze(0) < lengths.unsqueeze(1)
    old = -torch.rand(4, 4, generator=g) * 3
    adv = torch.randn(4, generator=g)
    grads = []
    for loss in (cls(loss_agg_mode=mode, max_response_length=5), GRPOLoss(loss_agg_mode=mode, max_response_length=5)):
        lp = old.clone().requires_grad_(True)
        loss(lp, old, adv, mask, num_tokens=int(mask.sum()), num_seqs=4).loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[1].abs().sum() > 0


@pytest.mark.parametrize("cls", [CISPOLoss, GMPOLoss, SAPOLoss])
def test_garbage_padding_stays_finite(cls):
    logprobs = torch.tensor([[-1.0, float("-inf")], [float("nan"), float("-inf")]], requires_grad=True)
    old = torch.tensor([[-1.2, float("nan")], [float("-inf"), 0.0]])  # r = e^0.2: unclipped for all three
    mask = torch.tensor([[True, False], [False, False]])
    out = cls(loss_agg_mode="seq-mean-token-mean")(
        logprobs, old, torch.tensor([1.0, -1.0]), mask, num_tokens=1, num_seqs=2,
        importance_weights=torch.tensor([[0.5, float("nan")], [float("inf"), 1.0]]),
    )
    out.loss.backward()
    assert all(torch.isfinite(v).all() for v in out)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 0] != 0


def test_importance_weights_scale_the_policy_term():
    # On-policy GRPO token-mean, A = [1, -0.5], weights [[2, 0.5], [3, (padding)]], 3 tokens:
    #   p = -A w = [-2, -0.5 | 1.5] -> (-2 - 0.5 + 1.5) / 3 = -1/3; gradient -A w / 3.
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])
    w = torch.tensor([[2.0, 0.5], [3.0, 9.0]])
    out = GRPOLoss()(logprobs, logprobs.detach(), torch.tensor([1.0, -0.5]), mask, num_tokens=3, num_seqs=2,
                     importance_weights=w)
    # Ratio exp(0) = 1, the products -A w exact, their sum exact; only / 3 rounds (3e-8). Bound: 1e-6.
    assert out.loss.item() == pytest.approx(-1 / 3, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, -0.5], [1.5, 0.0]]) / 3)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="epsilon_high"):
        CISPOLoss(epsilon_high=-1.0)
    with pytest.raises(ValueError, match="epsilon_low"):
        GMPOLoss(epsilon_low=-0.1)
    with pytest.raises(ValueError, match="tau_neg"):
        SAPOLoss(tau_neg=0.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        SAPOLoss(loss_agg_mode="sum")
    with pytest.raises(ValueError, match="importance_weights"):
        logprobs, old, adv, mask = _off_policy()
        CISPOLoss()(logprobs, old, adv, mask, num_tokens=5, num_seqs=2, importance_weights=torch.ones(2, 2))


def test_formula_lines_state_the_parameters():
    assert "clip(r_i,t, 0, 1 + 0.28)" in "\n".join(CISPOLoss().formula_lines())
    assert "clip(r_i,t, 1 - 0.2, 1 + 5)" in "\n".join(CISPOLoss(epsilon_high=5.0, epsilon_low=0.2).formula_lines())
    gmpo = "\n".join(GMPOLoss(epsilon_high=0.3).formula_lines())
    assert "min(x_i,t, 0.3) where A_i > 0, max(x_i,t, -0.4) where A_i <= 0" in gmpo
    assert "tau_i = 1 where A_i > 0, 1.05 otherwise" in "\n".join(SAPOLoss().formula_lines())
