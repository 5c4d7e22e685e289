"""Where a step's rollouts come from: :class:`PromptStream` and :class:`RolloutProducer`.

:class:`PromptStream` hands out this rank's prompt batches across epochs (the sampler reshuffled at each
epoch, the position restored on resume). :class:`RolloutProducer` turns a batch into scored groups with the
current policy: one generation round, or with DAPO's dynamic sampling more rounds on new prompts until the
batch can be filled; every rank runs the same number of rounds (they agree with one all-reduce per round).

The producer runs on the trainer's own ranks, colocated and synchronous;
:class:`~torchtune_grpo.workers.client.WorkerRollouts` (``generation_workers``) is the same part on a
generation worker process, overlapped with training.
"""

import dataclasses
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, List, Optional

import torch
from torch import nn

from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtune_grpo.data import collate_prompts, PromptBatch
from torchtune_grpo.rollouts.group_selection import DynamicSampling
from torchtune_grpo.generation import GenerationEngine
from torchtune_grpo.metrics.sums import one_process_sum
from torchtune_grpo.multiturn import MultiTurn
from torchtune_grpo.rewards import RewardSet
from torchtune_grpo.rollouts.groups import RolloutGroups, sample_and_score

__all__ = ["FixedRollouts", "PromptStream", "RolloutProducer"]


class PromptStream:
    """This rank's prompt batches, epoch after epoch.

    Args:
        dataloader (Any): a ``StatefulDataLoader`` over the prompts (its ``state_dict`` holds the position).
        sampler (Any): its ``DistributedSampler`` (``set_epoch`` reshuffles).
        epoch (int): the epoch to start in (a resumed run's). Default is 0.
    """

    def __init__(self, dataloader: Any, sampler: Any, epoch: int = 0) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.epoch = int(epoch)
        self._batches: Optional[Any] = None

    @classmethod
    def over(
        cls, dataset: Any, *, batch_size: int, world_size: int, rank: int, shuffle: bool, seed: int
    ) -> "PromptStream":
        """This rank's share of ``dataset``: every ``world_size``-th prompt of each epoch's (seeded) order,
        in batches of ``batch_size``; the last incomplete batch of an epoch is dropped on every rank alike.

        Raises:
            ValueError: when the dataset has fewer prompts than one global batch.
        """
        sampler = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        loader = StatefulDataLoader(
            dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_prompts, drop_last=True
        )
        if len(loader) == 0:
            raise ValueError(
                f"The dataset has {len(dataset)} prompts: fewer than batch_size x world_size = "
                f"{batch_size * world_size}."
            )
        return cls(loader, sampler)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.dataloader)

    def next(self) -> PromptBatch:
        """The next batch, starting a new (reshuffled) epoch when one ends.

        ``DistributedSampler(drop_last=True)`` gives every rank the same number of batches, so all ranks roll
        over together.
        """
        while True:
            if self._batches is None:
                self.sampler.set_epoch(self.epoch)
                self._batches = iter(self.dataloader)  # resumes mid-epoch after load_state_dict
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
                self.epoch += 1


class RolloutProducer:
    """Scored rollouts of one step on this rank (see the module docstring).

    Args:
        engine (GenerationEngine): samples completions.
        tokenizer: the policy's tokenizer.
        rewards (RewardSet): scores them.
        prompts (PromptStream): where new prompts come from (dynamic sampling's extra rounds).
        group_size (int): completions per prompt.
        batch_size (int): prompts (groups) per rank per step.
        max_new_tokens (int): the response budget.
        generator (torch.Generator): this rank's sampling RNG.
        dynamic (Optional[DynamicSampling]): dynamic sampling; None is one round. Default is None.
        multi_turn (Optional[MultiTurn]): multi-turn episodes instead of single completions. Default is None.
        generation_context (Callable[[], ContextManager]): entered around each generation call (FSDP2: the
            parameters gathered once per round, not once per decoded token). Default is no context.
        all_reduce_sum (Callable[[List[float]], List[float]]): sums floats over ranks. Default is one process.
    """

    def __init__(
        self,
        *,
        engine: GenerationEngine,
        tokenizer: Any,
        rewards: RewardSet,
        prompts: PromptStream,
        group_size: int,
        batch_size: int,
        max_new_tokens: int,
        generator: torch.Generator,
        dynamic: Optional[DynamicSampling] = None,
        multi_turn: Optional[MultiTurn] = None,
        generation_context: Callable[[], ContextManager] = nullcontext,
        all_reduce_sum: Callable[[List[float]], List[float]] = one_process_sum,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.prompts = prompts
        self.group_size = int(group_size)
        self.batch_size = int(batch_size)
        self.max_new_tokens = int(max_new_tokens)
        self.generator = generator
        self.dynamic = dynamic if dynamic is not None else DynamicSampling()
        self.multi_turn = multi_turn
        self.generation_context = generation_context
        self.all_reduce_sum = all_reduce_sum

    def round(self, policy: nn.Module, batch: PromptBatch) -> RolloutGroups:
        """One generation round: ``group_size`` completions for each prompt of ``batch``, scored."""
        policy.eval()  # no dropout while sampling
        return sample_and_score(
            policy, self.tokenizer, self.engine, batch, self.rewards, group_size=self.group_size,
            max_new_tokens=self.max_new_tokens, generator=self.generator,
            generation_context=self.generation_context(), multi_turn=self.multi_turn,
        )

    def greedy(self, policy: nn.Module, batch: PromptBatch) -> RolloutGroups:
        """One greedy completion of each prompt of ``batch``, scored (diagnostics; the training RNG untouched)."""
        policy.eval()
        return sample_and_score(
            policy, self.tokenizer, self.engine, batch, self.rewards, group_size=1, temperature=0.0,
            max_new_tokens=self.max_new_tokens, generator=torch.Generator(device=self.generator.device).manual_seed(0),
            generation_context=self.generation_context(), multi_turn=self.multi_turn,
        )

    def collect(self, policy: nn.Module, batch: Optional[PromptBatch] = None) -> "tuple[RolloutGroups, int]":
        """The step's rounds: ``batch``'s (default: the next prompts), then (dynamic sampling) rounds on new
        prompts until every rank has enough informative groups or ``max_rounds`` is reached. Returns the
        groups and the rounds run."""
        first = self.round(policy, batch if batch is not None else self.prompts.next())
        return self.dynamic.run_rounds(
            first, lambda: self.round(policy, self.prompts.next()), self.batch_size, self.all_reduce_sum
        )


class FixedRollouts:
    """A producer that returns the same given rollouts every step, in one round: for replaying recorded or
    scripted rollouts through a recipe's real update (benchmarks/learning_replay.py), in place of
    :class:`RolloutProducer`.

    The replayed groups' sampling and scoring seconds are zeroed: nothing is sampled or scored on a replay,
    and the step subtracts them from its ``time/train`` (step time less generation and reward time).

    Args:
        rollouts (RolloutGroups): what :meth:`collect` returns (with zero generation and reward seconds).
    """

    def __init__(self, rollouts: RolloutGroups) -> None:
        self.rollouts = dataclasses.replace(rollouts, generation_seconds=0.0, reward_seconds=0.0)

    def collect(self, policy: nn.Module, batch: Any = None) -> "tuple[RolloutGroups, int]":
        return self.rollouts, 1
