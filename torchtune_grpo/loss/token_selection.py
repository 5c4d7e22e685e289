"""Train only on the high-entropy "forking" tokens (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy
Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning", arXiv:2506.01939).

The paper keeps the policy gradient of the top 20% of tokens by the policy's entropy at their position and
drops the rest. Here the threshold is **global**: the ``ceil(q * M)``-th largest entropy over the response
tokens of the whole step (all micro-batches and all processes, ``M`` tokens after the other masks), with the
entropies of ``pi_old`` (the policy that sampled, which is the policy being trained on the first update of
a step), computed before the update. So the selected set, and with it the token and sequence counts of the
loss, are fixed before the update and the same whatever the micro-batch size and the number of processes;
a per-micro-batch threshold would select a different set for each split. The price: one no-grad forward
pass before the update when ``ppo_epochs: 1`` (otherwise the recipe computes ``pi_old`` anyway), and the
selection does not change between the ``ppo_epochs`` updates of a step.

Unselected tokens leave the loss like masked tokens: they leave ``M`` (``token-mean``) and their
sequence's length ``|o_i|`` (``seq-mean-token-mean``); every sequence stays in the sequence count ``N``
(a sequence with no selected token adds 0, like an empty answer). Pure: tensors in, tensors out.
"""

import math

import torch

__all__ = ["HighEntropyTokens"]


class HighEntropyTokens:
    """Keep the top ``fraction`` of response tokens by ``pi_old``'s entropy, over the global batch.

    Args:
        fraction (float): ``q`` in ``(0, 1]``; the paper's 0.2. Default is 0.2.

    Raises:
        ValueError: on a fraction outside ``(0, 1]``.
    """

    def __init__(self, fraction: float = 0.2) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"token_selection.fraction must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)

    def threshold(self, entropies: torch.Tensor) -> float:
        """The ``ceil(q * K)``-th largest of ``entropies [K]`` (every rank's response tokens); -inf if empty."""
        k = math.ceil(self.fraction * entropies.numel())
        if k == 0:
            return float("-inf")
        return torch.topk(entropies.detach().double().flatten(), k).values[-1].item()

    def select(self, entropy: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """``mask`` minus the tokens whose entropy is below ``threshold`` (ties are kept), ``[B, T]`` bool.

        Args:
            entropy (torch.Tensor): ``pi_old``'s entropy at each position, ``[B, T]``.
            mask (torch.Tensor): ``[B, T]`` bool, the tokens that would be trained on.
            threshold (float): from :meth:`threshold` over the global batch.

        Returns:
            torch.Tensor: ``[B, T]`` bool.
        """
        return mask.bool() & (entropy.detach().double() >= threshold)

    def formula_line(self) -> str:
        """The selection as an algorithm-card line."""
        return (
            f"tokens     only the top {self.fraction:g} of response tokens by entropy H_old(o_i,t) of pi_old, "
            "over the global batch, stay in the loss (and in M and |o_i|)   [high-entropy tokens, Wang et al. 2025]"
        )
