"""Token-budget micro-batches (torchtune_grpo/training/micro_batches.py, `max_tokens_per_micro_batch`).

The plan by hand; every row exactly once and within the budget; the count agreed over ranks; and the
update (every loss aggregation mode) and the no-grad logprob passes independent of the split: the same
weights and logprobs as fixed micro-batches (fp32). 1 vs 2 processes with a token budget:
tests/test_algorithms_recipe.py::test_every_variant_is_independent_of_micro_batches_and_processes (run C).
"""

import copy
import random

import pytest
import torch

from tests.conftest import make_tiny_decoder
from tests.tolerances import logit_ulps
from torchtune_grpo.loss import GRPOLoss
from torchtune_grpo.training.micro_batches import agreed_counts, agreed_plan, count_histogram, plan_micro_batches
from torchtune_grpo.training.batch import TrainingBatch
from torchtune_grpo.training.batch import batch_token_logprobs
from torchtune_grpo.training.experience import Experience
from torchtune_grpo.training.update import PolicyUpdate

G = 3


def test_unshared_plan_by_hand():
    # Lengths (prompt + response): 10, 4, 7, 3, 12, 4. Sorted longest first: rows 4 (12), 0 (10), 2 (7),
    # 1 (4), 5 (4), 3 (3). Budget 24: [4, 0] costs 2 x 12 = 24; adding 2 would be 3 x 12 = 36 > 24.
    # [2, 1, 5] costs 3 x 7 = 21; adding 3 gives 4 x 7 = 28 > 24. [3] alone.
    prompts = [5, 2, 3, 2, 6, 2]
    responses = [5, 2, 4, 1, 6, 2]
    plan = plan_micro_batches(prompts, responses, max_tokens=24, max_rows=8)
    assert plan.order == [4, 0, 2, 1, 5, 3] and plan.sizes == [2, 3, 1]
    assert plan.slices() == [slice(0, 2), slice(2, 5), slice(5, 6)]
    # The row cap binds too: at most 2 rows per micro-batch.
    assert plan_micro_batches(prompts, responses, max_tokens=24, max_rows=2).sizes == [2, 2, 2]
    # A sequence over the budget travels alone.
    assert plan_micro_batches(prompts, responses, max_tokens=5, max_rows=8).sizes == [1] * 6
    # Exactly 4 micro-batches (e.g. another rank needs 4): the costliest one ([4, 0], 24 tokens) is halved.
    plan4 = plan_micro_batches(prompts, responses, max_tokens=24, max_rows=8, num_micro_batches=4)
    assert plan4.order == [4, 0, 2, 1, 5, 3] and plan4.sizes == [1, 1, 3, 1]
    with pytest.raises(ValueError, match="not between 3"):
        plan_micro_batches(prompts, responses, max_tokens=24, max_rows=8, num_micro_batches=2)


def test_shared_plan_cuts_groups_only_where_cheaper():
    # Three groups of 3 (prompt lengths 4, 2, 3). A shared row costs P + M x max(1, C - 1), C the longest
    # response of the row. Each group's responses sorted longest first, cut where that is cheaper:
    # A (rows 0, 2, 1: 6, 3, 2): whole 4 + 3 x 5 = 19; [0] + [2, 1] = (4 + 5) + (4 + 2 x 2) = 17: cut.
    # B (rows 4, 5, 3: 2, 2, 1): whole 2 + 3 x 1 = 5, any cut pays the prompt again: whole.
    # C (rows 6, 7, 8: 10, 1, 1): whole 3 + 3 x 9 = 30; [6] + [7, 8] = 12 + 5 = 17: cut.
    a, b, c = [1, 1, 1, 1], [2, 2], [3, 3, 3]
    prompt_ids = [a] * 3 + [b] * 3 + [c] * 3
    responses = [6, 2, 3, 1, 2, 2, 10, 1, 1]
    lens = [len(p) for p in prompt_ids]
    # Units by cost: [6] 12, [0] 9, [2, 1] 8, B 5, [7, 8] 5. Budget 40: [6] + [0] = 2 x (4 + 1 x 9) = 26
    # (26 - 12 <= 2 x 9); + [2, 1]: 3 x (4 + 2 x 9) > 40. [2, 1] + B = 2 x (4 + 3 x 2) = 20, but that adds
    # 12 > 2 x 5 (padding B's short completions to 3): no. B + [7, 8] = 2 x (3 + 3 x 1) = 12.
    # (Within a micro-batch the units go in prompt order: group A's [0] before C's [6].)
    plan = plan_micro_batches(lens, responses, max_tokens=40, max_rows=9, prompt_ids=prompt_ids)
    assert plan.order == [0, 6, 2, 1, 4, 5, 3, 7, 8] and plan.sizes == [2, 2, 5]
    # Budget 20: [6] + [0] = 26 > 20: [6] alone. [0] + [2, 1] share a prompt, so one row of 4 + 3 x 5 = 19:
    # group A rejoined (the cut was cheaper only in separate rows).
    plan = plan_micro_batches(lens, responses, max_tokens=20, max_rows=9, prompt_ids=prompt_ids)
    assert plan.order == [6, 0, 2, 1, 4, 5, 3, 7, 8] and plan.sizes == [1, 3, 5]
    # One long completion among short ones: cut into [0] (4 + 29 = 33) and [1, 2, 3] (4 + 3 x 1 = 7); rejoined
    # they would be one row of 4 + 4 x 29 = 120 (87 more for a part of 7), so they stay apart.
    plan = plan_micro_batches([4] * 4, [30, 1, 1, 1], max_tokens=1000, max_rows=4, prompt_ids=[a] * 4)
    assert plan.order == [0, 1, 2, 3] and plan.sizes == [1, 3]


@pytest.mark.parametrize("shared", [False, True])
def test_random_plans_cover_every_row_within_the_budget(shared):
    rng = random.Random(0)
    for trial in range(30):
        groups = rng.randint(1, 6)
        prompt_ids, responses = [], []
        for g in range(groups):
            p = [g + 1] * rng.randint(2, 20)
            for _ in range(G):
                prompt_ids.append(p)
                responses.append(int(rng.lognormvariate(2.5, 1.0)) + 1)
        lens = [len(p) for p in prompt_ids]
        budget, cap = rng.choice([30, 64, 200]), rng.randint(1, 8)
        batch = TrainingBatch(prompt_ids, [[7] * r for r in responses], 0, share_prompt=shared)
        plan = batch.plan(max_tokens=budget, max_rows=cap)
        assert sorted(plan.order) == list(range(len(lens))), trial
        for s in plan.slices():
            ordered = batch.select(plan.order, row_width=plan.row_width)
            tokens = ordered.padded_tokens(s)
            # Over the budget only alone: one sequence (or, shared, one group's part of one sequence).
            assert tokens <= budget or s.stop - s.start == 1, (trial, s, tokens, budget)
            assert s.stop - s.start <= cap
        more = plan_micro_batches(
            lens, responses, max_tokens=budget, max_rows=cap, prompt_ids=prompt_ids if shared else None,
            num_micro_batches=len(lens),
        )
        assert more.sizes == [1] * len(lens) and sorted(more.order) == list(range(len(lens)))


def test_micro_batch_counts_agree_over_ranks():
    # Two ranks' histograms summed, as the sum all-reduce does: the largest count wins, per histogram.
    rank0 = count_histogram(2, 6) + count_histogram(5, 6)
    rank1 = count_histogram(3, 6) + count_histogram(1, 6)
    summed = [x + y for x, y in zip(rank0, rank1)]
    assert agreed_counts(summed, 6) == [3, 5]
    # agreed_plan asks once and then plans exactly that many.
    calls = []

    def all_reduce(values):
        calls.append(values)
        return [x + y for x, y in zip(values, count_histogram(5, 6))]  # the other rank needs 5

    plan = agreed_plan([3] * 6, [1, 2, 3, 4, 5, 6], max_tokens=100, max_rows=6, all_reduce=all_reduce)
    assert len(calls) == 1 and len(plan.sizes) == 5 and sorted(plan.order) == list(range(6))


def _experience(model, seed=0, num_groups=4):
    # Long-tailed response lengths, so the budget really reorders and splits the rows.
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(num_groups):
        p = [rng.randrange(1, 97) for _ in range(rng.randint(3, 9))]
        for _ in range(G):
            prompts.append(p)
            responses.append([rng.randrange(1, 97) for _ in range(min(40, int(rng.lognormvariate(1.5, 0.9)) + 1))])
    return prompts, responses


LAYOUTS = {"padded": dict(share_prompt=False), "shared": dict(share_prompt=True),
           "packed": dict(share_prompt=False, pack=True)}


def _batch_and_exp(model, prompts, responses, layout):
    batch = TrainingBatch(prompts, responses, pad_id=0, **LAYOUTS[layout])
    n = len(batch)
    kept = torch.ones(n, dtype=torch.bool)
    kept[4] = False
    gen = torch.Generator().manual_seed(3)
    old = batch_token_logprobs(model, batch, micro_batch_size=n).logprobs
    return Experience(
        batch=batch, mask=batch.response_mask & kept.unsqueeze(1), kept=kept,
        advantages=torch.randn(n, generator=gen), old_logprobs=old,
        ref_logprobs=old + 0.01 * torch.randn(old.shape, generator=gen), engine_logprobs=None,
    )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_grad_logprobs_do_not_depend_on_the_plan(layout):
    model = make_tiny_decoder(scale=1.0)
    prompts, responses = _experience(model, seed=1)
    batch = TrainingBatch(prompts, responses, 0, **LAYOUTS[layout])
    ref = batch_token_logprobs(model, batch, micro_batch_size=len(batch), with_entropy=True)
    plan = batch.plan(max_tokens=40, max_rows=4)
    assert len(plan.sizes) > 3 and plan.order != sorted(plan.order)  # really reordered and split
    out = batch_token_logprobs(model, batch, micro_batch_size=1, with_entropy=True, plan=plan)
    # One row at a time against the whole batch: other matmul shapes (and padding), so the logits round
    # differently. A logprob is a logit minus a logsumexp, an entropy a logsumexp minus sum p z: each a few-ulp
    # result of ~9 matmuls at the logits' magnitude (|z| up to ~75 here, 1 ulp = 7.6e-6), whatever the
    # logprob's own size: about sqrt(9) = 3 ulp each side. Bound: 16 ulp of the largest logit (measured:
    # 2.3e-5, 3 ulp, with AVX-512 and AVX2 kernels, 1.5e-5 with scalar ones).
    atol = logit_ulps(model, [p + r for p, r in zip(prompts, responses)], 16)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=atol, rtol=0)
    torch.testing.assert_close(out.entropy, ref.entropy, atol=atol, rtol=0)


# Each aggregation mode with a learning rate that moves the weights without chaos: a token sum has gradients
# ~10x a mean's, and a larger step makes ratios cross the clip boundary on float noise.
AGG_MODES = {"token-mean": 0.1, "seq-mean-token-mean": 0.1, "seq-mean-token-sum": 0.01, "seq-mean-token-sum-norm": 0.1}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_update_with_a_token_budget_equals_fixed_micro_batches(layout):
    # Every aggregation mode, 2 mini-batches x 2 passes (off-policy steps clip), KL and an entropy bonus:
    # a token budget that sorts and splits each mini-batch gives the weights of one micro-batch per
    # mini-batch, and so do the plans when another rank forces more micro-batches than the budget needs.
    model = make_tiny_decoder(seed=4, scale=0.5).train()
    prompts, responses = _experience(model, seed=2)
    exp = _batch_and_exp(model, prompts, responses, layout)
    for mode, lr in AGG_MODES.items():
        results = []
        for max_tokens, others_need in ((None, 0), (60, 0), (60, 6)):
            m = copy.deepcopy(model)
            calls = []

            def all_reduce(values, others_need=others_need):
                calls.append(len(values))
                if others_need:  # another rank's histograms: it needs `others_need` micro-batches each time
                    width = len(exp) // 2 + 1
                    values = [v + (1.0 if (i - 8) % width == others_need else 0.0) if i >= 8 else v
                              for i, v in enumerate(values)]
                return values

            update = PolicyUpdate(
                m, torch.optim.SGD(m.parameters(), lr=lr),
                GRPOLoss(epsilon=0.2, loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01, max_response_length=40),
                ppo_epochs=2, ppo_mini_batches=2, group_size=G, shuffle=False,
                micro_batch_size=len(exp) if max_tokens is None else 4, max_tokens_per_micro_batch=max_tokens,
                all_reduce=all_reduce,
            )
            if max_tokens is not None:
                plan = update._plan(exp, slice(0, len(exp) // 2))
                assert 1 < len(plan.sizes) < 6  # the budget splits the mini-batch (and fewer than forced)
            stats = update(exp)
            assert len(calls) == 1  # counts and micro-batch histograms in one all-reduce
            results.append(({k: p.detach().clone() for k, p in m.named_parameters()}, stats.losses))
        (base, base_stats), *others = results
        # The plans group the same per-token terms into other micro-batches (sorted, split, padded otherwise): each
        # gradient is the same sum regrouped (~sqrt(n) ulp of its partial sums, n ~ 100 tokens per mini-batch), on
        # logits of other matmul shapes (a few ulp), and SGD moves the weights by lr x that, rounding each weight once
        # (|w| <~ 2.3 with these x0.5 weights: 1 ulp 2.4e-7) per update; 2 mini-batches x 2 passes compound it, the
        # off-policy passes feeding the earlier differences back through the ratios. Measured: 3.0e-6 (12 ulp of the
        # largest weight) with AVX-512 and AVX2, 2.2e-6 with scalar kernels. Bound: 1e-5 (~40 ulp of the largest
        # weight). The logged losses are regrouped fp32 sums of magnitude <~ 0.5 (1 ulp 6e-8): measured 1.8e-6; bound
        # 1e-5.
        for weights, losses in others:
            for k, v in base.items():
                torch.testing.assert_close(weights[k], v, atol=1e-5, rtol=0, msg=lambda s: f"{mode} {k}: {s}")
            for key in ("loss", "policy_loss", "kl", "entropy", "clip_fraction"):
                assert float(losses[key]) == pytest.approx(float(base_stats[key]), abs=1e-5), (mode, key)
        assert max((base[k] - model.state_dict()[k]).abs().max().item() for k in base) > 1e-3  # it trained
        assert float(base_stats["clip_fraction"]) > 0
