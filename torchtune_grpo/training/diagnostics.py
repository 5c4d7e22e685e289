"""Closed-loop diagnostics of a training step (``step_diagnostics: true``; docs/benchmarks/closed_loop.md, the
late learning gap against TRL): what a policy samples after it was trained, fed into its next update, measured per step.

Each rank sums its part (:class:`~torchtune_grpo.metrics.sums.StepSums`, reduced over ranks by key like every
step metric):

- ``diagnostics/kl_step``: the KL from the policy before the step to the policy after it, on the step's own
  samples (tokens drawn from the policy before): ``mean_t (log pi_before(o_t) - log pi_after(o_t))`` over the
  trained response tokens, the k1 estimator, unbiased on samples of ``pi_before``;
- ``diagnostics/sampled_accuracy``: the fraction of the step's sampled completions that are correct (the
  ``eval_reward`` component ``>= eval_threshold``, as held-out evaluation judges);
- ``diagnostics/greedy_accuracy``: the same for one greedy completion of each of the step's prompts, with
  the policy before the update (one extra greedy round per step);
- ``advantage/abs_mean`` (every step, diagnostics on or off): the mean ``|A_i|`` of the trained sequences.

The entropy at the sampled positions (``entropy``) and the fraction of groups with identical rewards
(``zero_std_fraction``) are logged every step already.
"""

from typing import Callable, Optional

import torch
from torch import nn

from torchtune_grpo.data import PromptBatch
from torchtune_grpo.metrics.sums import StepSums
from torchtune_grpo.rollouts.groups import RolloutGroups

__all__ = ["StepDiagnostics", "advantage_sums"]


def advantage_sums(advantages: torch.Tensor) -> StepSums:
    """``("advantage_abs",)``: the sum of ``|A_i|`` over this rank's trained sequences ``[N]``."""
    sums = StepSums()
    sums.add(("advantage_abs",), advantages.abs().double().sum().item())
    return sums


class StepDiagnostics:
    """The closed-loop diagnostics of a step (see the module docstring).

    Args:
        correctness (str): the reward component that decides "correct".
        threshold (float): a completion is correct when that component is ``>= threshold``.
        greedy (Callable[[nn.Module, PromptBatch], RolloutGroups]): one greedy, scored completion per prompt
            with the policy (the producer's :meth:`~torchtune_grpo.rollouts.producer.RolloutProducer.greedy`).
        logprobs (Callable[[nn.Module, object], torch.Tensor]): the layout's logprobs ``[N, T]`` under a model,
            no grad (the experience builder's).
    """

    def __init__(
        self, correctness: str, threshold: float, greedy: Callable[[nn.Module, PromptBatch], RolloutGroups],
        logprobs: Callable[[nn.Module, object], torch.Tensor],
    ) -> None:
        self.correctness = correctness
        self.threshold = float(threshold)
        self.greedy = greedy
        self.logprobs = logprobs

    def before_update(self, policy: nn.Module, generated: RolloutGroups) -> StepSums:
        """Accuracy of the step's samples and of greedy completions of its prompts (the policy before)."""
        sums = StepSums()
        sampled = generated.per_component[self.correctness] >= self.threshold
        sums.add(("diagnostics", "sampled_correct"), sampled.sum().item())
        first = [g * generated.group_size for g in range(generated.num_groups)]
        prompts = PromptBatch([generated.prompt_ids[i] for i in first], list(generated.prompts), list(generated.fields))
        greedy = self.greedy(policy, prompts)
        sums.add(("diagnostics", "greedy_correct"), (greedy.per_component[self.correctness] >= self.threshold).sum().item())
        sums.add(("diagnostics", "prompts"), generated.num_groups)
        return sums

    def after_update(self, policy: nn.Module, experience: object, before: Optional[torch.Tensor]) -> StepSums:
        """The k1 KL from the policy before the step (``before``: its logprobs ``[N, T]``) to the one after."""
        if before is None:
            raise RuntimeError("step_diagnostics needs the old logprobs (the experience builder computes them)")
        after = self.logprobs(policy, experience.batch)
        mask = experience.mask.to(after.dtype)
        sums = StepSums()
        sums.add(("diagnostics", "kl_sum"), ((before - after) * mask).double().sum().item())
        sums.add(("diagnostics", "tokens"), mask.sum().item())
        return sums
