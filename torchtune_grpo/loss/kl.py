"""KL estimators to a reference policy, as a loss term or as a per-sequence reward penalty.

KL estimators k1/k2/k3 from Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html);
``"k3+"`` is verl's straight-through variant.
"""

from typing import Optional

import torch

__all__ = ["KL_ESTIMATORS", "MAX_LOG_RATIO", "kl_estimate", "kl_reward_penalty"]

#: Valid ``kl_estimator`` values: see :func:`kl_estimate`.
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")

# |log ratio| is clamped to this before exp (as verl does): exp(20) ~ 5e8 is already far outside any clip
# range, and an unclamped exp can overflow to inf, whose backward (0 * inf) is NaN even where the token's
# gradient should be 0.
MAX_LOG_RATIO = 20.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi``.

    With ``d = log pi_ref(o_t) - log pi(o_t)`` (Schulman 2020, "Approximating KL Divergence"):

    - ``"k1"``: ``-d``. Unbiased, high variance, often negative. Gradient wrt ``logprobs``: ``1`` (its
      expectation under ``pi`` is 0: as a loss term it only adds noise; use it as a reward penalty).
    - ``"k2"``: ``d**2 / 2``. Biased, low variance, >= 0. Gradient: ``-d``.
    - ``"k3"``: ``exp(d) - d - 1``. Unbiased, low variance, >= 0 (GRPO's choice). Gradient:
      ``1 - exp(d) = 1 - pi_ref / pi``.
    - ``"k3+"``: the value of k3 with the gradient of k2 (straight-through,
      ``k3.detach() + k2 - k2.detach()``), as verl's ``"k3+"``: k2's gradient is the gradient of the true
      KL's Taylor expansion and does not explode where ``pi_ref >> pi``.

    ``d`` is clamped to ``[-20, 20]`` (no gradient beyond), so ``exp`` never overflows.

    Args:
        logprobs (torch.Tensor): ``log pi`` of the sampled tokens, shape ``[B, T]`` (may require grad).
        ref_logprobs (torch.Tensor): ``log pi_ref`` of the same tokens, shape ``[B, T]`` (constants).
        estimator (str): one of :data:`KL_ESTIMATORS`. Default is ``"k3"``.
        mask (Optional[torch.Tensor]): True on real tokens, ``[B, T]`` bool; other positions give exactly 0
            (and no NaN even if the inputs hold garbage there). Default is None (every position).

    Returns:
        torch.Tensor: per-token KL estimate, shape ``[B, T]``.

    Raises:
        ValueError: on an unknown estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; valid estimators are {list(KL_ESTIMATORS)}")
    d = ref_logprobs.detach() - logprobs
    if mask is not None:
        d = torch.where(mask.bool(), d, torch.zeros_like(d))
    d = d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    if estimator == "k1":
        return -d
    k2 = 0.5 * d * d
    if estimator == "k2":
        return k2
    k3 = torch.expm1(d) - d  # expm1: exact for small d, where exp(d) - 1 cancels
    if estimator == "k3":
        return k3
    return k3.detach() + (k2 - k2.detach())  # "k3+"


def kl_reward_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> torch.Tensor:
    """Per-sequence KL penalty to subtract from the reward: ``kl_coef * sum_t k(d_t)``, detached.

    This is the KL "in the reward" of RLHF-PPO (Ziegler et al. 2019, arXiv:1909.08593; Ouyang et al.
    2022, arXiv:2203.02155), as opposed to GRPO's KL "in the loss": with ``k1`` the sum over the
    response is ``log pi(o | q) - log pi_ref(o | q)``, the sequence's log-likelihood ratio. The
    penalised reward ``R_i - penalty_i`` then goes through the advantage estimator like any reward.

    Args:
        logprobs (torch.Tensor): ``log pi_old`` of the sampled tokens (the policy that sampled them),
            shape ``[B, T]``.
        ref_logprobs (torch.Tensor): ``log pi_ref``, shape ``[B, T]``.
        mask (torch.Tensor): True on response tokens, ``[B, T]`` bool.
        kl_coef (float): the penalty's weight.
        estimator (str): one of :data:`KL_ESTIMATORS`. Default is ``"k1"``.

    Returns:
        torch.Tensor: penalty per sequence, shape ``[B]``, float32 (0 for empty responses).
    """
    with torch.no_grad():
        kl = kl_estimate(logprobs.detach(), ref_logprobs, estimator, mask=mask)
        return kl_coef * torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum(dim=-1).float()
