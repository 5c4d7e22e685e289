"""The policy update (torchtune_grpo/training/update.py) with several optimizer steps per step (`ppo_mini_batches`).

On a tiny decoder, in fp32 with SGD (the update is the raw gradient): each mini-batch is one optimizer step
normalised by its own token/sequence counts (the same as separate one-step updates on each mini-batch),
whatever the micro-batch size; the counts of every mini-batch go through one all-reduce; the learning-rate
schedule steps once per optimizer step; the shuffle keeps groups whole and is seeded. 1 vs 2 processes is
tests/test_algorithms_recipe.py::test_every_variant_is_independent_of_micro_batches_and_processes.
"""

import copy
import random

import pytest
import torch

from tests.conftest import make_tiny_decoder
from torchtune_grpo.loss import GRPOLoss
from torchtune_grpo.training.batch import TrainingBatch
from torchtune_grpo.training.batch import batch_logprobs
from torchtune_grpo.training.experience import Experience
from torchtune_grpo.training.update import PolicyUpdate

G = 3  # completions per prompt


def _experience(model, num_groups=4, seed=0) -> Experience:
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(num_groups):
        p = [rng.randrange(1, 97) for _ in range(rng.randint(3, 7))]
        for _ in range(G):
            prompts.append(p)
            responses.append([rng.randrange(1, 97) for _ in range(rng.randint(1, 6))])
    batch = TrainingBatch(prompts, responses, pad_id=0)
    n = len(batch)
    kept = torch.ones(n, dtype=torch.bool)
    kept[4] = False  # e.g. a truncated completion (DAPO's overlong filtering): out of the loss and the counts
    mask = batch.response_mask & kept.unsqueeze(1)
    gen = torch.Generator().manual_seed(seed)
    return Experience(
        batch=batch, mask=mask, kept=kept, advantages=torch.randn(n, generator=gen),
        old_logprobs=batch_logprobs(model, batch, micro_batch_size=n),  # pi_old: the policy before the update
        ref_logprobs=None, engine_logprobs=None,
    )


class _CountingScheduler:
    def __init__(self):
        self.steps = 0

    def step(self):
        self.steps += 1


def _train(model, exp, *, k, mbs, epochs=1, shuffle=False, all_reduce=None, scheduler=None, step=0):
    model = copy.deepcopy(model)
    update = PolicyUpdate(
        model, torch.optim.SGD(model.parameters(), lr=0.5), GRPOLoss(epsilon=0.2, loss_agg_mode="seq-mean-token-mean"),
        ppo_epochs=epochs, ppo_mini_batches=k, group_size=G, micro_batch_size=mbs, shuffle=shuffle, seed=7,
        lr_scheduler=scheduler, **({"all_reduce": all_reduce} if all_reduce else {}),
    )
    stats = update(exp, step=step)
    return {name: p.detach().clone() for name, p in model.named_parameters()}, stats


def test_each_mini_batch_is_one_step_normalised_by_its_own_counts():
    model = make_tiny_decoder(seed=0, scale=0.1)
    exp = _experience(model)  # 12 rows, 4 groups
    calls = []

    def all_reduce(values):
        calls.append(list(values))
        return values

    two, stats = _train(model, exp, k=2, mbs=12, all_reduce=all_reduce)
    assert stats.losses["clip_fraction"] > 0  # the second mini-batch is off-policy: its ratios get clipped
    # One all-reduce with [tokens, sequences] of each mini-batch: rows 0-5 (row 4 not kept) and rows 6-11.
    mask = exp.mask
    assert calls == [[mask[:6].sum().item(), 5.0, mask[6:].sum().item(), 6.0]]
    # The reference: two one-step updates, the second on the first's weights, each on its own rows (so its
    # own counts), both against the same pi_old.
    reference = copy.deepcopy(model)
    for rows in (torch.arange(0, 6), torch.arange(6, 12)):
        weights, _ = _train(reference, exp.select(rows), k=1, mbs=6)
        reference.load_state_dict(weights, strict=False)
    # The same two one-step updates on the same rows (one step per mini-batch, each over its own counts): the
    # same computation with the same shapes here (measured: bitwise equal). The 2-row micro-batches below
    # regroup each gradient's sum over a mini-batch's ~20 response tokens (~sqrt(20) = 4-5 ulp of its partial
    # sums) before the SGD step (lr 0.5), on weights |w| <~ 1.2 (x0.1 weights; 1 ulp 1.2e-7): measured 1.2e-7
    # (1 ulp) with AVX-512, AVX2 and scalar kernels. Bound: 1e-5 (~80 ulp) for both.
    for name, p in reference.named_parameters():
        torch.testing.assert_close(two[name], p.detach(), atol=1e-5, rtol=0, msg=name)
    # Micro-batches of 2 rows split groups and mini-batches differently: the same update.
    split, _ = _train(model, exp, k=2, mbs=2)
    for name in two:
        torch.testing.assert_close(split[name], two[name], atol=1e-5, rtol=0, msg=name)
    # And it is not the one-step update on all rows.
    one, _ = _train(model, exp, k=1, mbs=12)
    assert max((one[n] - two[n]).abs().max().item() for n in one) > 1e-4


def test_optimizer_steps_and_the_schedule():
    model = make_tiny_decoder(seed=1, scale=0.1)
    exp = _experience(model)
    scheduler = _CountingScheduler()
    _, stats = _train(model, exp, k=2, mbs=4, epochs=3, shuffle=True, scheduler=scheduler)
    assert scheduler.steps == 6  # ppo_epochs 3 x ppo_mini_batches 2
    assert torch.isfinite(torch.as_tensor(stats.losses["loss"]))


def test_shuffle_keeps_groups_whole_and_is_seeded():
    model = make_tiny_decoder(seed=2, scale=0.1)
    exp = _experience(model, num_groups=6)
    exp.advantages = torch.arange(18, dtype=torch.float32)  # row ids, to follow the rows
    update = PolicyUpdate(model, torch.optim.SGD(model.parameters(), lr=0.1), GRPOLoss(),
                          ppo_mini_batches=3, group_size=G, micro_batch_size=4, seed=7)
    orders = {}
    for step, epoch in ((5, 0), (5, 1), (6, 0)):
        shuffled = update.epoch_order(exp, step, epoch)
        rows = shuffled.advantages.long()
        groups = rows.view(-1, G)  # each mini-batch slice of 6 rows holds 2 whole groups
        assert torch.equal(groups - groups[:, :1], torch.arange(G).expand_as(groups))
        assert torch.equal(groups[:, 0] % G, torch.zeros(6, dtype=torch.long))
        assert sorted(rows.tolist()) == list(range(18))
        # every row's tensors and sequences moved together
        assert torch.equal(shuffled.mask, exp.mask[rows]) and torch.equal(shuffled.kept, exp.kept[rows])
        assert shuffled.batch.response_ids == [exp.batch.response_ids[i] for i in rows.tolist()]
        assert torch.equal(shuffled.batch.tokens, exp.batch.tokens[rows])
        # Exact: the same values reindexed.
        torch.testing.assert_close(shuffled.old_logprobs, exp.old_logprobs[rows], atol=0, rtol=0)
        assert torch.equal(update.epoch_order(exp, step, epoch).advantages, shuffled.advantages)  # seeded
        orders[(step, epoch)] = rows.tolist()
    assert len({tuple(o) for o in orders.values()}) == 3  # a new order per pass and per step
    assert orders[(5, 0)] != list(range(18))
    update.shuffle = False
    assert torch.equal(update.epoch_order(exp, 5, 0).advantages, exp.advantages)


def test_groups_that_do_not_split_evenly_are_an_error():
    model = make_tiny_decoder(seed=3, scale=0.1)
    exp = _experience(model)  # 4 groups
    update = PolicyUpdate(model, torch.optim.SGD(model.parameters(), lr=0.1), GRPOLoss(),
                          ppo_mini_batches=3, group_size=G, micro_batch_size=4)
    with pytest.raises(ValueError, match="4 groups of 3 do not split into ppo_mini_batches = 3"):
        update(exp)
