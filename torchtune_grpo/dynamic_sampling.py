"""DAPO's dynamic sampling: train only on prompt groups whose rewards differ.

A group whose ``G`` rewards are all equal (every completion right, or every one wrong) has zero
advantage everywhere: it adds nothing to the policy gradient but still dilutes it through the loss
normaliser and costs a training forward/backward. DAPO (Yu et al. 2025, arXiv:2503.14476, section 3.2)
drops such groups and keeps generating (from new prompts) until the batch is full of informative groups.

Here (per rank, pure; the recipe runs the rounds and the collectives):

1. A generation round turns ``batch_size`` prompts into ``batch_size`` groups of scored completions
   (:class:`RolloutGroups`).
2. While a rank has fewer than ``batch_size`` informative groups and fewer than ``max_rounds`` rounds were
   run, every rank runs another round on the next ``batch_size`` prompts of its dataloader (the recipe
   all-reduces "does any rank still need groups?", so all ranks run the same number of rounds, which
   generation and FSDP collectives need).
3. :meth:`DynamicSampling.select` keeps the first ``batch_size`` informative groups in generation order. If
   ``max_rounds`` ran out first, the batch is topped up with zero-variance groups (zero advantage: they
   change only the normalisers), so every rank still trains on exactly ``batch_size`` groups.

Informative means "not zero-variance" as defined by
:func:`torchtune_grpo.advantages.zero_variance_groups`: robust to float noise in rewards that should be
equal. The filter looks at the task reward (the sum of ``reward_functions``), before any KL penalty.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Sequence

import torch

from torchtune_grpo.advantages import ZERO_VARIANCE_RTOL, zero_variance_groups

__all__ = ["DynamicSampling", "GroupSelection", "RolloutGroups"]


@dataclass
class RolloutGroups:
    """Scored completions of ``num_groups`` prompts, ``group_size`` each: what generation rounds produced.

    Row ``i`` (of ``N = num_groups x group_size``) answers prompt ``i // group_size``.

    Attributes:
        group_size (int): completions per prompt, ``G``.
        prompts (List[str]): prompt text, one per group.
        fields (List[Dict[str, Any]]): the prompt's dataset columns, one per group.
        prompt_ids (List[List[int]]): prompt token ids, one per row.
        response_ids (List[List[int]]): completion token ids, one per row.
        completions (List[str]): decoded completions, one per row.
        truncated (torch.Tensor): ``[N]`` bool, True where no stop token came within the budget.
        rewards (torch.Tensor): ``[N]`` float32, the weighted sum of the reward components.
        per_component (Dict[str, torch.Tensor]): each component's ``[N]`` scores.
        errors (Dict[str, int]): samples given the fallback, per component, counted when scored (a
            selection keeps the counts of everything that was scored).
    """

    group_size: int
    prompts: List[str]
    fields: List[Dict[str, Any]]
    prompt_ids: List[List[int]]
    response_ids: List[List[int]]
    completions: List[str]
    truncated: torch.Tensor
    rewards: torch.Tensor
    per_component: Dict[str, torch.Tensor] = field(default_factory=dict)
    errors: Dict[str, int] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        """Number of prompt groups."""
        return len(self.prompts)

    def select(self, groups: Sequence[int]) -> "RolloutGroups":
        """The given groups, in that order."""
        g = self.group_size
        rows = [gi * g + j for gi in groups for j in range(g)]
        index = torch.tensor(rows, dtype=torch.long)
        return RolloutGroups(
            group_size=g,
            prompts=[self.prompts[i] for i in groups],
            fields=[self.fields[i] for i in groups],
            prompt_ids=[self.prompt_ids[i] for i in rows],
            response_ids=[self.response_ids[i] for i in rows],
            completions=[self.completions[i] for i in rows],
            truncated=self.truncated[index],
            rewards=self.rewards[index],
            per_component={k: v[index] for k, v in self.per_component.items()},
            errors=dict(self.errors),
        )

    @staticmethod
    def concat(parts: Sequence["RolloutGroups"]) -> "RolloutGroups":
        """The groups of several rounds, one after the other (errors are summed)."""
        if not parts:
            raise ValueError("concat needs at least one RolloutGroups")
        if len(parts) == 1:
            return parts[0]
        errors: Dict[str, int] = {}
        for p in parts:
            for k, v in p.errors.items():
                errors[k] = errors.get(k, 0) + int(v)
        return RolloutGroups(
            group_size=parts[0].group_size,
            prompts=[x for p in parts for x in p.prompts],
            fields=[x for p in parts for x in p.fields],
            prompt_ids=[x for p in parts for x in p.prompt_ids],
            response_ids=[x for p in parts for x in p.response_ids],
            completions=[x for p in parts for x in p.completions],
            truncated=torch.cat([p.truncated for p in parts]),
            rewards=torch.cat([p.rewards for p in parts]),
            per_component={k: torch.cat([p.per_component[k] for p in parts]) for k in parts[0].per_component},
            errors=errors,
        )


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
