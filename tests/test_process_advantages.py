"""Process-supervised advantages (torchtune_grpo/rollouts/process_advantages.py) against values worked out by
hand, and token-level advantages through every policy loss and the update's micro-batches.

DeepSeekMath (arXiv:2402.03300, section 4.1.3): step scores normalised over every step of the group (sample
std), a token's advantage the sum of the normalised scores of the steps ending at or after it.
"""

import copy
import math

import pytest
import torch

from tests.conftest import make_tiny_decoder
from tests.test_micro_batching import G as MB_G, _batch_and_exp, _experience
from tests.tolerances import ulps
from torchtune_grpo import loss as losses
from torchtune_grpo.loss import LOSS_AGG_MODES
from torchtune_grpo.loss.token_advantages import sequence_advantages
from torchtune_grpo.rollouts.groups import RolloutGroups
from torchtune_grpo.rollouts.process_advantages import ProcessSupervisedAdvantage
from torchtune_grpo.training.batch import TrainingBatch
from torchtune_grpo.training.experience import ExperienceBuilder
from torchtune_grpo.training.update import PolicyUpdate

EPS = 1e-6


def test_steps_of_unequal_length_by_hand():
    # One group of 2. Row 0: 5 tokens, steps ending at tokens 1 and 4, scored 1 and 0. Row 1: 3 tokens, one
    # step (tokens 0-2) scored 1. Group scores {1, 0, 1}: mean 2/3, sample std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2)
    # = sqrt(1/3); with s = sqrt(1/3) + eps: r~ = (1/3) / s for a 1 and -(2/3) / s for the 0.
    s = math.sqrt(1 / 3) + EPS
    up, down = (1 / 3) / s, -(2 / 3) / s
    out = ProcessSupervisedAdvantage()(torch.zeros(2), [[1.0, 0.0], [1.0]], [[1, 4], [2]], [5, 3], group_size=2)
    expected = torch.tensor([
        [up + down, up + down, down, down, down],  # tokens 0-1 see both steps, 2-4 only the second
        [up, up, up, 0.0, 0.0],                    # past its 3 tokens: 0
    ])
    # float64 arithmetic rounded once to float32: within 1 float32 ulp of the values (|A| < 2).
    torch.testing.assert_close(out.advantages, expected.float(), atol=2 * torch.finfo(torch.float32).eps, rtol=0)
    assert out.normalized_steps[0] == pytest.approx([up, down], abs=1e-12)
    assert out.zero_std.tolist() == [False]


def test_one_step_completions_are_the_outcome_estimator():
    # Each completion one step: the group's step scores are its G scores, so every token of completion i
    # carries (r_i - mean) / (std + eps), GRPO's outcome advantage of those scores: [0, 1, 2] -> mean 1,
    # sample std 1 -> [-1, 0, 1] / (1 + eps).
    out = ProcessSupervisedAdvantage()(torch.zeros(3), [[0.0], [1.0], [2.0]], [[3], [1], [0]], [4, 2, 1], 3)
    expected = torch.tensor([[-1.0] * 4, [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]) / (1 + EPS)
    torch.testing.assert_close(out.advantages, expected, atol=2 * torch.finfo(torch.float32).eps, rtol=0)


def test_a_group_with_equal_step_scores_gets_exactly_zero():
    # Group 0: every step 0.3 (one computed as 0.1 + 0.2, 4e-17 off): no process signal, exactly 0, never
    # noise / eps. Group 1 ({0, 1}: mean 0.5, std sqrt(0.5)) is unaffected by group 0.
    scores = [[0.3, 0.1 + 0.2], [0.3], [0.0], [1.0]]
    out = ProcessSupervisedAdvantage()(torch.zeros(4), scores, [[0, 1], [0], [0], [1]], [2, 1, 1, 2], 2)
    assert out.zero_std.tolist() == [True, False]
    assert out.advantages[:2].abs().max().item() == 0.0
    r = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(out.advantages[2:], torch.tensor([[-r, 0.0], [r, r]]), atol=1e-7, rtol=0)


@pytest.mark.parametrize("w_outcome, w_process", [(1.0, 1.0), (0.5, 2.0)])
def test_outcome_plus_process(w_outcome, w_process):
    # Outcome [1, 0]: mean 0.5, sample std sqrt(0.5) -> +-0.5 / (sqrt(0.5) + eps) = +-o for every token.
    # Steps: row 0 = [1] over 2 tokens, row 1 = [0, 0] ending at 0 and 1: {1, 0, 0}: mean 1/3, std sqrt(1/3);
    # r~ = (2/3) / s and -(1/3) / s. Row 1, token 0 sees both its steps (-2/3 / s), token 1 only the last.
    o = 0.5 / (math.sqrt(0.5) + EPS)
    s = math.sqrt(1 / 3) + EPS
    p0, p1 = (2 / 3) / s, -(1 / 3) / s
    out = ProcessSupervisedAdvantage(outcome_weight=w_outcome, process_weight=w_process)(
        torch.tensor([1.0, 0.0]), [[1.0], [0.0, 0.0]], [[1], [0, 1]], [2, 2], 2
    )
    expected = torch.tensor([
        [w_outcome * o + w_process * p0] * 2,
        [-w_outcome * o + w_process * 2 * p1, -w_outcome * o + w_process * p1],
    ])
    torch.testing.assert_close(out.advantages, expected.float(), atol=8 * torch.finfo(torch.float32).eps, rtol=0)
    text = ProcessSupervisedAdvantage(outcome_weight=w_outcome, process_weight=w_process).formula
    assert "end(i,j) >= t" in text and "mean(R_group)" in text and "DeepSeekMath" in text


def test_malformed_steps_name_the_row():
    est = ProcessSupervisedAdvantage()
    with pytest.raises(ValueError, match="row 1: step ends must strictly increase"):
        est(torch.zeros(2), [[1.0], [1.0, 0.0]], [[0], [2, 2]], [1, 3], 2)
    with pytest.raises(ValueError, match=r"row 0: step ends \[4\] outside the response's tokens 0..2"):
        est(torch.zeros(2), [[1.0], [1.0]], [[4], [0]], [3, 1], 2)
    with pytest.raises(ValueError, match="row 0: 2 step scores but 1 step ends"):
        est(torch.zeros(2), [[1.0, 0.0], [1.0]], [[0], [0]], [3, 1], 2)
    with pytest.raises(ValueError, match="both 0"):
        ProcessSupervisedAdvantage(outcome_weight=0.0, process_weight=0.0)


def _groups(per_component, step_scores, step_ends, responses):
    n = len(responses)
    return RolloutGroups(
        group_size=2, prompts=["p"] * (n // 2), fields=[{}] * (n // 2), prompt_ids=[[5, 6, 7]] * n,
        response_ids=responses, completions=[""] * n, truncated=torch.zeros(n, dtype=torch.bool),
        rewards=sum(per_component.values()), per_component=per_component, step_scores=step_scores,
        step_ends=step_ends, step_component="steps",
    )


def test_experience_builder_lays_out_token_advantages_with_the_kl_penalty_in_the_outcome():
    # Outcome = the non-step components (weight 1 on "correct"; the step component's weight 0.5 is not in it)
    # less the KL penalty of kl_placement: reward: [1 - 0.25, 0 - 0.25] -> +-0.5 / (sqrt(0.5) + eps) = +-o.
    # Steps {1, 0}: +-r with r = 0.5 / (sqrt(0.5) + eps). Response token j of a row sits in logprob column
    # len(prompt) - 1 - start + j = j (start = 2: every prompt has 3 tokens).
    trained = _groups({"correct": torch.tensor([1.0, 0.0]), "steps": torch.tensor([1.0, 0.0])},
                      [[1.0], [0.0]], [[1], [0]], [[11, 12], [13]])
    builder = ExperienceBuilder(
        advantage=ProcessSupervisedAdvantage(outcome_weight=1.0), reward_weights=[1.0, 0.5], group_size=2,
        pad_id=0, loss_masks=None, micro_batch_size=2, temperature=1.0, device=torch.device("cpu"),
    )
    layout = TrainingBatch(trained.prompt_ids, trained.response_ids, 0, share_prompt=False)
    adv = builder.token_advantages(trained, torch.tensor([0.25, 0.25]), layout)
    o = r = 0.5 / (math.sqrt(0.5) + EPS)
    torch.testing.assert_close(adv, torch.tensor([[o + r, o + r], [-o - r, 0.0]]), atol=1e-6, rtol=0)
    no_steps = _groups({"correct": torch.tensor([1.0, 0.0])}, None, None, [[11], [13]])
    with pytest.raises(ValueError, match="needs a step-level reward in reward_functions"):
        builder.token_advantages(no_steps, torch.zeros(2), layout)


LOSSES = [
    ("GRPOLoss", {}), ("GRPOLoss", {"ratio_level": "sequence"}), ("GRPOLoss", {"dual_clip": 1.5}),
    ("CISPOLoss", {}), ("GMPOLoss", {}), ("SAPOLoss", {}),
]


@pytest.mark.parametrize("name, kwargs", LOSSES, ids=[f"{n}{'-' + next(iter(k)) if k else ''}" for n, k in LOSSES])
def test_every_loss_and_mode_takes_token_advantages(name, kwargs):
    # [B, T] advantages equal along each row give the [B] loss and gradient, in every aggregation mode, with KL
    # and entropy terms and off-policy ratios. The loss is the same products summed in the same order: exact.
    # A sequence-level ratio (GSPO, GMPO) backpropagates sum_t(-A g_t) instead of -A sum_t g_t: the T = 6 products
    # rounded once each and summed in another order, so the gradients may differ by up to ~2T ulp of the
    # largest gradient (token-level losses: exactly equal, the bound only admits what reordering can do).
    gen = torch.Generator().manual_seed(0)
    b, t = 4, 6
    old = -torch.rand(b, t, generator=gen) * 3
    logits = (old + 0.3 * torch.randn(b, t, generator=gen)).requires_grad_()
    mask = torch.rand(b, t, generator=gen) > 0.2
    adv = torch.randn(b, generator=gen)
    ref = old - 0.1
    entropy = torch.rand(b, t, generator=gen)
    for mode in LOSS_AGG_MODES:
        fn = getattr(losses, name)(loss_agg_mode=mode, max_response_length=t, kl_coef=0.1, entropy_coef=0.01, **kwargs)
        results = []
        for a in (adv, adv.unsqueeze(1).expand(b, t).clone()):
            lp = logits.detach().clone().requires_grad_()
            out = fn(lp, old, a, mask, ref_logprobs=ref, entropy=entropy, num_tokens=int(mask.sum()), num_seqs=b)
            out.loss.backward()
            results.append((out, lp.grad))
        (seq, seq_grad), (tok, tok_grad) = results
        assert torch.equal(seq.loss, tok.loss), (name, mode)
        torch.testing.assert_close(tok_grad, seq_grad, atol=ulps(seq_grad, 2 * t), rtol=0)
        assert seq_grad.abs().sum() > 0
    with pytest.raises(ValueError, match=r"advantages must be \[B\] = \[4\] .* or \[B, T\] = \[4, 6\]"):
        getattr(losses, name)(**kwargs)(logits, old, torch.zeros(4, 5), mask, num_tokens=1, num_seqs=1)


def test_token_advantages_weight_each_token_by_hand():
    # On-policy (ratio 1, unclipped) GRPO, token-mean: loss = -sum_t A_t rho_t / num_tokens, so
    # d loss / d logprob_t = -A_t / num_tokens on the mask and 0 elsewhere, exactly.
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.0, 0.5], [0.25, 3.0, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = losses.GRPOLoss()(lp, lp.detach(), adv, mask, num_tokens=5, num_seqs=2)
    out.loss.backward()
    assert torch.equal(lp.grad, torch.where(mask, -adv / 5, torch.zeros_like(adv)))
    assert sequence_advantages(adv, mask).tolist() == [pytest.approx(0.5), pytest.approx(1.625)]


def test_update_with_token_advantages_does_not_depend_on_micro_batches():
    # The update's mini-batches (2, 2 passes) over micro-batches: a token budget that sorts and splits rows gives
    # the weights of one micro-batch per mini-batch, with per-token advantages (each row carries its own). The
    # bound is tests/test_micro_batching.py's (the same regrouped sums, its derivation): 1e-5 on the weights, ~40
    # ulp of the largest (|w| 2.3). lr 0.05 moves the weights by ~0.03: at 0.1 seq-mean-token-mean moved them by
    # 1.4 and ratios crossed the clip boundary on float noise (2.2e-5 apart with AVX2 kernels). Measured at 0.05:
    # 1.2e-7 to 4.2e-7 with AVX-512, AVX2 and scalar kernels.
    model = make_tiny_decoder(seed=4, scale=0.5).train()
    prompts, responses = _experience(model, seed=2)
    exp = _batch_and_exp(model, prompts, responses, "padded")
    exp.advantages = torch.randn(exp.mask.shape, generator=torch.Generator().manual_seed(5))  # [N, T]
    for mode in ("token-mean", "seq-mean-token-mean"):
        results = []
        for max_tokens in (None, 60):
            m = copy.deepcopy(model)
            update = PolicyUpdate(
                m, torch.optim.SGD(m.parameters(), lr=0.05),
                losses.GRPOLoss(epsilon=0.2, loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01),
                ppo_epochs=2, ppo_mini_batches=2, group_size=MB_G, shuffle=False,
                micro_batch_size=len(exp) if max_tokens is None else 4, max_tokens_per_micro_batch=max_tokens,
            )
            update(exp)
            results.append({k: p.detach().clone() for k, p in m.named_parameters()})
        for k, v in results[0].items():
            torch.testing.assert_close(results[1][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{mode} {k}: {s}")
        assert max((results[0][k] - model.state_dict()[k]).abs().max().item() for k in results[0]) > 1e-3
