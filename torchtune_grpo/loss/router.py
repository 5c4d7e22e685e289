"""Router losses and statistics of mixture-of-experts policies, as token sums (the caller divides by global counts).

- Load balancing (Switch Transformer: Fedus et al. 2021, "Switch Transformers: Scaling to Trillion Parameter
  Models with Simple and Efficient Sparsity", arXiv:2101.03961, eq. 4): ``E x sum_e f_e P_e`` per layer, ``f_e``
  the fraction of routing assignments that went to expert ``e`` and ``P_e`` the mean router probability of ``e``
  over the tokens. Here ``f`` is a constant measured over the whole step's batch before the update (the
  recorded routes, all processes), so the loss is a token mean of ``E x sum_e f_e p_{t,e}``: a sum over a
  micro-batch's tokens divided by the global token count adds up to the same value and gradient whatever the
  micro-batch size or the number of processes. Uniform routing gives 1.
- Router z-loss (ST-MoE: Zoph et al. 2022, "ST-MoE: Designing Stable and Transferable Sparse Expert Models",
  arXiv:2202.08906, eq. 5): the token mean of ``(log sum_e exp z_{t,e})^2``, which keeps the router's logits
  small.

Both are averaged over the MoE layers and taken over real tokens only (prompt and response, never padding).
"""

import torch

__all__ = ["expert_counts", "load_balance_sum", "z_loss_sum"]


def load_balance_sum(logits: torch.Tensor, real: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """``sum_t E x sum_e f_e softmax(z_t)_e`` over real tokens ``t`` (divide by the global token count).

    Args:
        logits (torch.Tensor): ``[T, E]`` one layer's router logits.
        real (torch.Tensor): ``[T]`` bool, real (not padding) tokens.
        fractions (torch.Tensor): ``[E]`` the batch's assignment fractions ``f`` (constant, sums to 1).

    Returns:
        torch.Tensor: a 0-d fp32 sum, differentiable in ``logits``.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
    per_token = logits.size(-1) * (probs * fractions.to(probs.device, torch.float32)).sum(-1)  # [T]
    return torch.where(real, per_token, torch.zeros_like(per_token)).sum()


def z_loss_sum(logits: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``sum_t (logsumexp_e z_{t,e})^2`` over real tokens ``t`` (divide by the global token count).

    Args:
        logits (torch.Tensor): ``[T, E]`` one layer's router logits.
        real (torch.Tensor): ``[T]`` bool, real tokens.

    Returns:
        torch.Tensor: a 0-d fp32 sum, differentiable in ``logits``.
    """
    per_token = torch.logsumexp(logits.float(), dim=-1) ** 2  # [T]
    return torch.where(real, per_token, torch.zeros_like(per_token)).sum()


def expert_counts(indices: torch.Tensor, real: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routing assignments per expert over real tokens: ``[E]`` float64.

    Args:
        indices (torch.Tensor): ``[T, k]`` experts per token (entries < 0: unknown, not counted).
        real (torch.Tensor): ``[T]`` bool, real tokens.
        num_experts (int): ``E``.
    """
    picked = indices[real.to(indices.device)].long().reshape(-1)
    picked = picked[picked >= 0]
    return torch.bincount(picked, minlength=num_experts).to(torch.float64).cpu()
