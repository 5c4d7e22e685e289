"""PromptStream and RolloutProducer (torchtune_grpo/rollouts/producer.py) without a process group."""

import dataclasses

import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.conftest import make_tiny_decoder
from torchtune_grpo.rollouts.group_selection import DynamicSampling
from torchtune_grpo.generation import NativeGenerator
from torchtune_grpo.rollouts.producer import FixedRollouts, PromptStream, RolloutProducer
from torchtune_grpo.data import collate_prompts
from torchtune_grpo.rewards import RewardSet


def _stream(n=6, batch=2, seed=0):
    rows = [{"tokens": [1 + i, 2 + i], "prompt": f"p{i}", "answer": str(i)} for i in range(n)]
    sampler = DistributedSampler(rows, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    loader = StatefulDataLoader(rows, batch_size=batch, sampler=sampler, collate_fn=collate_prompts, drop_last=True)
    return PromptStream(loader, sampler)


def test_prompt_stream_rolls_over_epochs_with_a_new_order():
    stream = _stream()
    first = [p for _ in range(3) for p in stream.next().prompts]
    assert stream.epoch == 0 and sorted(first) == [f"p{i}" for i in range(6)]
    second = [p for _ in range(3) for p in stream.next().prompts]
    assert stream.epoch == 1 and sorted(second) == sorted(first) and second != first  # reshuffled


class _Tok:
    pad_id, stop_tokens = 0, [96]

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))


def test_dynamic_sampling_runs_more_rounds_on_new_prompts_until_the_batch_fills():
    # A constant reward: every group is zero-variance, so dynamic sampling asks for rounds until max_rounds.
    stream = _stream()
    producer = RolloutProducer(
        engine=NativeGenerator(temperature=1.0), tokenizer=_Tok(), rewards=RewardSet([lambda b: [1.0] * len(b.completions)], [1.0]),
        prompts=stream, group_size=2, batch_size=2, max_new_tokens=3, generator=torch.Generator().manual_seed(0),
        dynamic=DynamicSampling(enabled=True, max_rounds=3),
    )
    generated, rounds = producer.collect(make_tiny_decoder(), stream.next())
    assert rounds == 3 and generated.num_groups == 6 and len(set(generated.prompts)) == 6  # new prompts each round
    assert generated.generation_seconds > 0
    replayed, rounds = FixedRollouts(generated).collect(None, None)
    # the same groups, without the sampling/scoring seconds (a replay samples nothing: time/train stays whole)
    assert rounds == 1 and replayed.generation_seconds == 0.0 and replayed.reward_seconds == 0.0
    assert replayed == dataclasses.replace(generated, generation_seconds=0.0, reward_seconds=0.0)


def test_a_dataset_smaller_than_one_global_batch_is_refused():
    import pytest

    rows = [{"tokens": [1], "prompt": "p", "answer": "1"}] * 3
    with pytest.raises(ValueError, match=r"The dataset has 3 prompts: fewer than batch_size x world_size = 4"):
        PromptStream.over(rows, batch_size=2, world_size=2, rank=0, shuffle=False, seed=0)
    assert len(PromptStream.over(rows, batch_size=1, world_size=2, rank=1, shuffle=False, seed=0)) == 1


def test_a_resume_on_another_number_of_processes_continues_the_epoch_where_it_stopped():
    from torchtune_grpo.checkpoints.manager import data_position_for

    rows = [{"tokens": [1 + i], "prompt": f"p{i}", "answer": str(i)} for i in range(40)]
    # DistributedSampler's epoch-0 order (seed 0): every process takes every world_size-th prompt of it.
    order = [f"p{i}" for i in torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()]

    def streams(world_size, batch):
        return [PromptStream.over(rows, batch_size=batch, world_size=world_size, rank=r, shuffle=True, seed=0)
                for r in range(world_size)]

    def resumed(saved, world_size, batch):
        new = streams(world_size, batch)
        for s in new:
            position, where = data_position_for(saved.dataloader.state_dict(), len(old), world_size, batch)
            s.dataloader.load_state_dict(position)
        return new, where

    # 2 processes x 2 prompts for 3 steps (the order's first 12), resumed on 1 process: the epoch goes on from
    # prompt 12 to its end, every prompt used once (restored as saved, it would go on from prompt 6).
    old = streams(2, 2)
    used = [p for _ in range(3) for s in old for p in s.next().prompts]
    assert sorted(used) == sorted(order[:12])
    (one,), where = resumed(old[0], 1, 2)
    assert where == "this epoch's first 12 prompts were used on 2 process(es); it continues on 1 from prompt 12"
    rest = [p for _ in range(14) for p in one.next().prompts]
    assert rest == order[12:] and one.epoch == 0
    # 1 process x 2 prompts for 5 steps (the first 10), resumed on 2 processes x 3: a step takes 6, so the epoch goes
    # on from prompt 6, the last 4 of the 10 used again, none skipped (restored as saved: from prompt 20).
    old = streams(1, 2)
    used = [p for _ in range(5) for p in old[0].next().prompts]
    two, where = resumed(old[0], 2, 3)
    assert where == ("this epoch's first 10 prompts were used on 1 process(es); it continues on 2 from prompt 6 "
                     "(4 used again)")
    assert sorted(p for s in two for p in s.next().prompts) == sorted(order[6:12])
    # Saved before the epoch's first batch: nothing to convert.
    fresh = streams(2, 2)[0].dataloader.state_dict()
    assert data_position_for(fresh, 2, 1, 2) == (fresh, "this epoch starts from its first prompt")
