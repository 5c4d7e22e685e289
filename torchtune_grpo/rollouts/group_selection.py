"""The groups a step trains on: DAPO's dynamic sampling, which trains only on prompt groups whose rewards differ.

A group whose ``G`` rewards are all equal (every completion right, or every one wrong) has zero
advantage everywhere: it adds nothing to the policy gradient but still dilutes it through the loss
normaliser and costs a training forward/backward. DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.2)
drops such groups and keeps generating (from new prompts) until the batch is full of informative groups.

Here (per rank, pure; the recipe runs the rounds and the collectives):

1. A generation round turns ``batch_size`` prompts into ``batch_size`` groups of scored completions
   (:class:`~torchtune_grpo.rollouts.groups.RolloutGroups`).
2. While a rank has fewer than ``batch_size`` informative groups and fewer than ``max_rounds`` rounds were
   run, every rank runs another round on the next ``batch_size`` prompts of its dataloader (the recipe
   all-reduces "does any rank still need groups?", so all ranks run the same number of rounds, which
   generation and FSDP collectives need).
3. :meth:`DynamicSampling.select` keeps the first ``batch_size`` informative groups in generation order. If
   ``max_rounds`` ran out first, the batch is topped up with zero-variance groups (zero advantage: they
   change only the normalisers), so every rank still trains on exactly ``batch_size`` groups.

Informative means "not zero-variance" as defined by
:func:`torchtune_grpo.rollouts.advantages.zero_variance_groups`: robust to float noise in rewards that should be
equal. The filter looks at the task reward (the sum of ``reward_functions``), before any KL penalty.
"""

from typing import Callable, List, NamedTuple, Tuple

import torch

from torchtune_grpo.rollouts.advantages import ZERO_VARIANCE_RTOL, zero_variance_groups
from torchtune_grpo.rollouts.groups import RolloutGroups

__all__ = ["DynamicSampling", "GroupSelection"]


class GroupSelection(NamedTuple):
    """Which generated groups a step trains on.

    Attributes:
        indices (List[int]): the groups to train on, ascending (generation order).
        dropped (int): zero-variance groups left out.
        filled (int): zero-variance groups used to top up the batch after the last round.
        surplus (int): informative groups left out because the batch was already full.
    """

    indices: List[int]
    dropped: int
    filled: int
    surplus: int


class DynamicSampling:
    """Dynamic sampling policy (see the module docstring); ``enabled=False`` is plain GRPO: one round.

    Config (a ``dynamic_sampling:`` section of the recipe config)::

        dynamic_sampling:
          enabled: True
          max_rounds: 4      # generation rounds per step at most (each on batch_size new prompts)

    Args:
        enabled (bool): drop zero-variance groups and resample. Default is False.
        max_rounds (int): most generation rounds per step, >= 1. Each round consumes ``batch_size`` prompts
            per rank. Default is 4.
        rtol (float): relative tolerance of "all rewards equal". Default is 1e-6.
    """

    def __init__(self, enabled: bool = False, max_rounds: int = 4, rtol: float = ZERO_VARIANCE_RTOL) -> None:
        if int(max_rounds) < 1:
            raise ValueError(f"dynamic_sampling.max_rounds must be >= 1, got {max_rounds}")
        if rtol < 0:
            raise ValueError(f"dynamic_sampling.rtol must be >= 0, got {rtol}")
        self.enabled = bool(enabled)
        self._max_rounds = int(max_rounds)
        self.rtol = float(rtol)

    @property
    def max_rounds(self) -> int:
        """Generation rounds per step at most: 1 when disabled."""
        return self._max_rounds if self.enabled else 1

    def informative(self, groups: RolloutGroups) -> torch.Tensor:
        """``[num_groups]`` bool: groups whose rewards are not all equal."""
        return ~zero_variance_groups(groups.rewards, groups.group_size, rtol=self.rtol)

    def needs_more(self, groups: RolloutGroups, num_groups: int) -> bool:
        """Whether this rank has fewer than ``num_groups`` informative groups (always False when disabled)."""
        return self.enabled and int(self.informative(groups).sum()) < num_groups

    def run_rounds(
        self, first: RolloutGroups, next_round: Callable[[], RolloutGroups], num_groups: int,
        all_reduce_sum: Callable[[List[float]], List[float]],
    ) -> Tuple[RolloutGroups, int]:
        """A step's rounds (step 2 of the module docstring): ``first``, then ``next_round()`` while some rank
        has fewer than ``num_groups`` informative groups and fewer than ``max_rounds`` rounds ran.

        Args:
            first (RolloutGroups): the step's first round.
            next_round (Callable[[], RolloutGroups]): one more round, on new prompts.
            num_groups (int): groups per rank per step (``batch_size``).
            all_reduce_sum (Callable[[List[float]], List[float]]): sums floats over ranks: one call per extra
                round considered, so every rank runs the same number of rounds.

        Returns:
            Tuple[RolloutGroups, int]: every round's groups, in generation order, and the number of rounds.
        """
        rounds = [first]
        while len(rounds) < self.max_rounds:
            wanted = self.needs_more(RolloutGroups.concat(rounds), num_groups)
            if all_reduce_sum([float(wanted)])[0] == 0:
                break
            rounds.append(next_round())
        return RolloutGroups.concat(rounds), len(rounds)

    def select(self, groups: RolloutGroups, num_groups: int) -> GroupSelection:
        """Chooses the ``num_groups`` groups to train on.

        Args:
            groups (RolloutGroups): every group generated this step, in generation order.
            num_groups (int): groups per rank per step (``batch_size``).

        Returns:
            GroupSelection: the chosen indices and what was left out.

        Raises:
            ValueError: if fewer than ``num_groups`` groups were generated.
        """
        total = groups.num_groups
        if total < num_groups:
            raise ValueError(f"{total} groups generated, fewer than the {num_groups} needed")
        if not self.enabled:
            return GroupSelection(indices=list(range(num_groups)), dropped=0, filled=0, surplus=0)
        informative = self.informative(groups).tolist()
        good = [i for i, ok in enumerate(informative) if ok]
        flat = [i for i, ok in enumerate(informative) if not ok]
        take = good[:num_groups]
        filled = flat[: num_groups - len(take)]
        return GroupSelection(
            indices=sorted(take + filled),
            dropped=len(flat) - len(filled),
            filled=len(filled),
            surplus=len(good) - len(take),
        )

    def __repr__(self) -> str:
        return f"DynamicSampling(enabled={self.enabled}, max_rounds={self._max_rounds}, rtol={self.rtol:g})"
