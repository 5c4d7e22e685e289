"""Advantages of either shape: one per sequence ``[B]`` (outcome rewards) or one per token ``[B, T]``
(process rewards, :class:`~torchtune_grpo.rollouts.process_advantages.ProcessSupervisedAdvantage`).

Every policy loss multiplies its per-token term by the advantage of that token, so both shapes meet in
:func:`advantage_columns`: ``[B] -> [B, 1]`` (broadcast over the row), ``[B, T]`` as it is. What needs one
number per sequence (the rollout correction's "negative advantage" test, the ``advantage_abs`` metric,
``completions.jsonl``) takes :func:`sequence_advantages`, the token mean over the loss mask.
"""

import torch

__all__ = ["advantage_columns", "sequence_advantages"]


def advantage_columns(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Advantages shaped to multiply a ``[B, T]`` per-token term.

    Args:
        advantages (torch.Tensor): ``[B]`` (one per sequence) or ``[B, T]`` (one per token).
        shape (torch.Size): ``(B, T)`` of the logprobs.

    Returns:
        torch.Tensor: ``[B, 1]`` or ``[B, T]``, the same values.

    Raises:
        ValueError: on any other shape.
    """
    if advantages.shape == shape[:1]:
        return advantages.unsqueeze(-1)
    if advantages.shape == shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] = [{shape[0]}] (one per sequence) or [B, T] = {list(shape)} (one per token), "
        f"got shape {tuple(advantages.shape)}"
    )


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence, ``[B]``: ``advantages`` when already ``[B]``, else the mean over each
    row's masked tokens (0 for a row without any).

    Args:
        advantages (torch.Tensor): ``[B]`` or ``[B, T]``.
        mask (torch.Tensor): ``[B, T]`` bool, the tokens that count.

    Returns:
        torch.Tensor: ``[B]``, the dtype of ``advantages``.
    """
    if advantages.dim() == 1:
        return advantages
    mask = mask.to(advantages.device).bool()
    total = torch.where(mask, advantages, torch.zeros_like(advantages)).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1).to(advantages.dtype)
