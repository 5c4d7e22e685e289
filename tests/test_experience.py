"""ExperienceBuilder (torchtune_grpo/training/experience.py): selected rollouts -> the update's input, without a
process group (the collectives default to one process)."""

import torch

from tests.conftest import make_tiny_decoder
from tests.tolerances import logit_ulps
from torchtune_grpo.rollouts.advantages import GroupRelativeAdvantage
from torchtune_grpo.training.experience import ExperienceBuilder, Reference
from torchtune_grpo.models.logprobs import sequence_logprobs
from torchtune_grpo.loss.masks import LossMasks
from torchtune_grpo.rollouts.groups import RolloutGroups

PAD = 0


def _rollouts() -> RolloutGroups:
    # 2 prompts x 2 completions. Row 1 is truncated; row 2 is a multi-turn episode whose 2nd and 3rd response
    # tokens were injected by the environment.
    return RolloutGroups(
        group_size=2, prompts=["a", "b"], fields=[{}, {}],
        prompt_ids=[[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]],
        response_ids=[[11, 12], [13, 14, 15, 16], [17, 18, 19, 20], [21]],
        completions=["", "", "", ""], truncated=torch.tensor([False, True, False, False]),
        rewards=torch.tensor([1.0, 0.0, 2.0, 2.0]), per_component={"r": torch.tensor([1.0, 0.0, 2.0, 2.0])},
        action_mask=[[1, 1], [1, 1, 1, 1], [1, 0, 0, 1], [1]],
    )


def _builder(**kwargs) -> ExperienceBuilder:
    options = dict(
        advantage=GroupRelativeAdvantage(scale_by_std=False), reward_weights=[1.0], group_size=2, pad_id=PAD,
        loss_masks=LossMasks(), micro_batch_size=3, temperature=1.0, device=torch.device("cpu"),
        share_prompt=False,
    )
    return ExperienceBuilder(**{**options, **kwargs})


def test_masks_advantages_and_what_is_not_computed():
    policy = make_tiny_decoder(seed=0)
    exp, kl_penalty = _builder(mask_truncated=True)(policy, _rollouts())
    # Loss mask per row: its own response tokens, not the environment's, none of a truncated row.
    assert exp.mask.sum(-1).tolist() == [2, 0, 2, 1]
    assert exp.kept.tolist() == [True, False, True, True]  # the truncated row leaves the sequence count
    # Group-relative, unscaled: group 1 (1, 0) -> (0.5, -0.5), group 2 (2, 2) -> 0; the truncated row still
    # shaped its group's baseline.
    assert exp.advantages.tolist() == [0.5, -0.5, 0.0, 0.0]
    # One optimizer step, no reference, no masks needing pi_old: no extra forwards.
    assert exp.old_logprobs is None and exp.ref_logprobs is None and kl_penalty.tolist() == [0.0] * 4
    assert policy.training  # left in train mode for the update


def test_reference_and_old_logprobs_are_the_models_logprobs_of_each_response():
    policy, reference = make_tiny_decoder(seed=0), make_tiny_decoder(seed=1)
    rollouts = _rollouts()
    exp, _ = _builder(reference=Reference(reference), update_needs_old_logprobs=True, kl_coef=0.1)(policy, rollouts)
    # The builder's forward runs the whole padded batch, the expected one each sequence alone: other matmul
    # shapes, so the logits (|z| up to ~190 with these x4 weights, 1 ulp = 1.5e-5) round differently. A logprob
    # is a logit minus a logsumexp, each a few-ulp result of ~9 matmuls (2 layers x 4, the head): its error is
    # a few ulp of the logits, whatever its own size (a likely token's logprob is ~0, where the former 1e-5 +
    # 1e-5 relative allowed less than one ulp of the logits). Bound: 16 ulp of the largest logit of each model
    # (measured: 4.6e-5, 3 ulp, with AVX-512 and AVX2 kernels, 3.1e-5 with scalar ones).
    sequences = [p + r for p, r in zip(rollouts.prompt_ids, rollouts.response_ids)]
    atol = {id(m): logit_ulps(m.eval(), sequences, 16) for m in (reference, policy)}
    for i, (prompt, response) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids)):
        tokens = torch.tensor([prompt + response])
        for model, got in ((reference, exp.ref_logprobs), (policy, exp.old_logprobs)):
            with torch.no_grad():
                expected = sequence_logprobs(model.eval(), tokens).logprobs[0, len(prompt) - 1:]  # [len(response)]
            torch.testing.assert_close(got[i][exp.batch.response_mask[i]], expected, atol=atol[id(model)], rtol=0)


def test_kl_in_the_reward_lowers_each_sequence_reward_before_the_advantage():
    # k1: each sequence's log-likelihood ratio to the reference (unscaled weights: the estimator clamps the
    # log-ratios of the peaked test models).
    policy, reference = make_tiny_decoder(seed=0, scale=1.0), make_tiny_decoder(seed=1, scale=1.0)
    builder = _builder(reference=Reference(reference), kl_coef=0.5, kl_estimator="k1", kl_in_reward=True)
    exp, kl_penalty = builder(policy, _rollouts())
    assert exp.old_logprobs is not None and (kl_penalty != 0).all()
    shaped = torch.tensor([1.0, 0.0, 2.0, 2.0]) - kl_penalty
    expected = (shaped.view(2, 2) - shaped.view(2, 2).mean(1, keepdim=True)).view(-1)
    torch.testing.assert_close(exp.advantages, expected)


def test_the_reference_context_is_entered_around_its_forwards():
    policy = make_tiny_decoder(seed=0)
    entered = []

    class Marker:
        def __enter__(self):
            entered.append(policy.training)
        def __exit__(self, *exc):
            return False

    builder = _builder(reference=Reference(policy, context=Marker), kl_coef=0.1)
    policy.train()
    builder(policy, _rollouts())
    assert entered == [False]  # entered once, with the model in eval mode
