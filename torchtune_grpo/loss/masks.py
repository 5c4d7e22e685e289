"""Masks and importance weights decided before the update, from the sampling policy ``pi_old``.

Two options act on which tokens and sequences the loss sees, both from quantities fixed before the first
optimizer step of a step (``pi_old``'s logprobs and entropy, the engine's sampling logprobs ``mu``, the
advantages):

- ``rollout_correction`` (:class:`~torchtune_grpo.loss.rollout_correction.RolloutCorrection`, engines with their own
  weights such as vLLM): importance weights ``pi_old / mu`` (truncated or masked) and off-policy
  sequence masks;
- ``token_selection`` (:class:`~torchtune_grpo.loss.token_selection.HighEntropyTokens`): only the top-q tokens
  by ``pi_old``'s entropy over the *global* batch.

Because both are decided before the update, the update's global token and sequence counts include them,
and the loss stays independent of micro-batch size and process count. :class:`LossMasks` applies them in
that order (the entropy threshold is taken over the tokens the correction kept). Pure apart from the
``gather`` callable the recipe passes (it concatenates a 1-D tensor over all ranks).
"""

from typing import Callable, Dict, NamedTuple, Optional

import torch

from torchtune_grpo.metrics.sums import StepSums
from torchtune_grpo.loss.rollout_correction import RolloutCorrection
from torchtune_grpo.loss.token_selection import HighEntropyTokens

__all__ = ["LossMaskOutput", "LossMasks"]


class LossMaskOutput(NamedTuple):
    """The rows' loss mask after :class:`LossMasks`.

    Attributes:
        mask (torch.Tensor): ``[N, T]`` bool, the tokens the loss sees.
        kept (torch.Tensor): ``[N]`` bool, the sequences in the sequence count.
        weights (Optional[torch.Tensor]): ``[N, T]`` importance weights multiplying each token's policy
            term, or None (all 1).
        sums (StepSums): this rank's quantities for the ``rollout_correction/*`` metrics
            (:data:`~torchtune_grpo.loss.rollout_correction.CORRECTION_METRICS`); empty without a correction.
    """

    mask: torch.Tensor
    kept: torch.Tensor
    weights: Optional[torch.Tensor]
    sums: StepSums


class LossMasks:
    """Rollout correction and high-entropy token selection, applied before the update.

    Args:
        rollout_correction (Optional[RolloutCorrection]): acts only when the engine reports its sampling
            logprobs. Default is None.
        token_selection (Optional[HighEntropyTokens]): Default is None.
    """

    def __init__(
        self,
        rollout_correction: Optional[RolloutCorrection] = None,
        token_selection: Optional[HighEntropyTokens] = None,
    ) -> None:
        self.rollout_correction = rollout_correction
        self.token_selection = token_selection

    @property
    def needs_entropy(self) -> bool:
        """Whether :meth:`__call__` needs ``pi_old``'s entropy."""
        return self.token_selection is not None

    def needs_old_logprobs(self, has_engine_logprobs: bool) -> bool:
        """Whether :meth:`__call__` needs ``pi_old`` computed before the update."""
        return self.needs_entropy or (self.rollout_correction is not None and has_engine_logprobs)

    def formula_lines(self) -> Dict[str, object]:
        """Algorithm-card lines: ``{"rollout_correction": [...] or None, "token_selection": str or None}``."""
        return {
            "rollout_correction": self.rollout_correction.formula_lines() if self.rollout_correction else None,
            "token_selection": self.token_selection.formula_line() if self.token_selection else None,
        }

    def __call__(
        self,
        mask: torch.Tensor,
        kept: torch.Tensor,
        advantages: torch.Tensor,
        *,
        old_logprobs: Optional[torch.Tensor],
        old_entropy: Optional[torch.Tensor],
        engine_logprobs: Optional[torch.Tensor],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> LossMaskOutput:
        """Apply the correction, then the token selection, to one rank's rows.

        Args:
            mask (torch.Tensor): ``[N, T]`` bool, response tokens of kept rows.
            kept (torch.Tensor): ``[N]`` bool.
            advantages (torch.Tensor): ``[N]`` or ``[N, T]`` (token-level).
            old_logprobs (Optional[torch.Tensor]): ``[N, T]`` ``log pi_old`` (required when
                :meth:`needs_old_logprobs`).
            old_entropy (Optional[torch.Tensor]): ``[N, T]`` ``pi_old``'s entropy (required with a token
                selection).
            engine_logprobs (Optional[torch.Tensor]): ``[N, T]`` the engine's ``log mu``, or None.
            gather (Callable[[torch.Tensor], torch.Tensor]): every rank's 1-D tensor, concatenated (the
                same on every rank); called once with a token selection, and then on every rank.

        Returns:
            LossMaskOutput: the reduced mask and kept rows, the weights and the metric sums.
        """
        weights, sums = None, StepSums()
        if self.rollout_correction is not None and engine_logprobs is not None:
            out = self.rollout_correction(old_logprobs, engine_logprobs, mask, advantages)
            mask, kept, weights, sums = out.mask, kept & out.kept, out.weights, out.sums
        if self.token_selection is not None:  # top-q entropy over every rank's tokens
            threshold = self.token_selection.threshold(gather(old_entropy[mask].detach().cpu()))
            mask = self.token_selection.select(old_entropy, mask, threshold)
        return LossMaskOutput(mask=mask, kept=kept, weights=weights, sums=sums)
