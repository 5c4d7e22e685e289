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
