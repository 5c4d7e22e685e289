"""Policy losses beyond PPO clipping: CISPO, GMPO and SAPO.

Each replaces only the policy term ``p_i,t`` of :class:`~torchtune_grpo.loss.base.PolicyGradientLoss`; the
aggregation modes, KL term, entropy bonus, TIS and rollout-correction weights are shared with
:class:`~torchtune_grpo.loss.GRPOLoss`. With ``r_i,t = pi_theta(o_i,t) / pi_old(o_i,t)``:

    CISPO  p_i,t = -sg(clip(r_i,t, 1 - eps_low, 1 + eps_high)) * A_i * log pi_theta(o_i,t)
           (MiniMax-M1, arXiv:2506.13585, eq. 4; sg = stop-gradient: every token keeps its gradient)
    GMPO   p_i,t = -A_i * exp((1 / |o_i|) * sum_t' clipped log r_i,t')     (the same for every token of i)
           clipped log r = min(log r, eps_high) where A_i > 0, max(log r, -eps_low) where A_i <= 0
           (Zhao et al. 2025, arXiv:2507.20673, Algorithm 1: the geometric mean of the token ratios,
           clipped token by token in log space)
    SAPO   p_i,t = -(4 / tau_i) * sigmoid(tau_i * (r_i,t - 1)) * A_i,   tau_i = tau_pos if A_i > 0 else tau_neg
           (Gao et al. 2025, arXiv:2511.20347: a smooth gate instead of the hard clip; its gradient weight
           4 sigma (1 - sigma) r is 1 on-policy and decays as r leaves 1, faster for negative advantages)

Every term depends only on its own sequence, so each loss stays independent of micro-batch and process
split. The papers' own aggregations: CISPO token-mean (``1 / sum_i |o_i|``), GMPO and SAPO
seq-mean-token-mean.
"""

from typing import List, Optional

import torch

from torchtune_grpo.loss.base import PolicyGradientLoss, PolicyTerm, clamp_log_ratio, masked_log_ratio, sequence_mean

__all__ = ["CISPOLoss", "GMPOLoss", "SAPOLoss"]


def _bound(value: Optional[float], name: str) -> Optional[float]:
    if value is not None and value < 0:
        raise ValueError(f"{name} must be >= 0 (or null), got {value}")
    return None if value is None else float(value)


class CISPOLoss(PolicyGradientLoss):
    """CISPO: a clipped, detached importance weight times the log-probability (MiniMax-M1, arXiv:2506.13585).

    ``p_i,t = -sg(clip(r_i,t, 1 - epsilon_low, 1 + epsilon_high)) * A_i * log pi_theta(o_i,t)``. Unlike PPO's
    clip, which zeroes the gradient of a token whose ratio left the range, CISPO only bounds the token's
    weight: the gradient is ``-clip(r) * A_i * grad log pi`` on every token (so low-probability "fork"
    tokens keep learning after the first update). On-policy (``r = 1``) the gradient equals GRPO's. The
    value contains ``log pi`` itself, so ``policy_loss`` is on another scale than GRPOLoss's.

    ``clip_fraction`` counts the tokens whose weight was clipped (they keep a gradient).

    Args:
        epsilon_high (float): upper bound ``r <= 1 + epsilon_high`` of the weight; the paper tunes only this
            one. Default is 0.28.
        epsilon_low (Optional[float]): lower bound ``r >= 1 - epsilon_low``; the paper imposes none
            (``epsilon_low`` "set to a large value"). Default is None (no lower bound).
        **kwargs: the aggregation, KL, entropy and TIS arguments of
            :class:`~torchtune_grpo.loss.base.PolicyGradientLoss`.

    Raises:
        ValueError: on a negative bound.
    """

    def __init__(self, epsilon_high: float = 0.28, epsilon_low: Optional[float] = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.epsilon_high = _bound(epsilon_high, "epsilon_high")
        self.epsilon_low = _bound(epsilon_low, "epsilon_low")

    def formula_lines(self) -> List[str]:
        low = "0" if self.epsilon_low is None else f"1 - {self.epsilon_low:g}"
        return [
            "ratio      r_i,t = pi_theta(o_i,t | q, o_i,<t) / pi_old(o_i,t | q, o_i,<t)   [token level]",
            f"policy     p_i,t = -sg(clip(r_i,t, {low}, 1 + {self.epsilon_high:g})) * A_i * log pi_theta(o_i,t)   "
            "[CISPO: sg = stop-gradient, every token keeps its gradient]",
        ]

    def _policy(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> PolicyTerm:
        with torch.no_grad():
            ratio = torch.exp(clamp_log_ratio(masked_log_ratio(logprobs, old_logprobs, mask)))  # [B, T]
            low = None if self.epsilon_low is None else 1.0 - self.epsilon_low
            weight = ratio.clamp(min=low, max=1.0 + self.epsilon_high)
            clipped = (ratio > 1.0 + self.epsilon_high) | ((ratio < low) if low is not None else False)
        # log pi at padding may be garbage (-inf): zero it, so neither value nor gradient sees it.
        logp = torch.where(mask, logprobs, torch.zeros_like(logprobs))
        return PolicyTerm(loss=-weight * adv * logp, ratio=ratio, clipped=clipped & mask)


class GMPOLoss(PolicyGradientLoss):
    """GMPO: the geometric mean of the token ratios of a sequence, clipped token by token in log space.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv:2507.20673 (Algorithm 1). With
    ``x_i,t = log r_i,t``, each token's log ratio is clipped on the side the advantage pushes towards
    (``min(x, epsilon_high)`` for ``A_i > 0``, ``max(x, -epsilon_low)`` otherwise, so the ratio range is
    ``(e^-epsilon_low, e^epsilon_high)``, the paper's ``(e^-0.4, e^0.4)``), then

        p_i = -A_i * exp((1 / |o_i|) * sum_t clipped x_i,t)

    is carried by every token of sequence ``i``; ``loss_agg_mode: seq-mean-token-mean`` gives the paper's
    ``(1 / N) sum_i p_i`` exactly. The gradient on token ``t`` is ``p_i / |o_i|`` times ``1`` where
    unclipped, ``0`` where clipped (per sequence, before aggregation). A token whose log ratio was clipped
    counts in ``clip_fraction``; ``ratio_mean`` reports the clipped geometric mean.

    Args:
        epsilon (float): log-space clip range on both sides. Default is 0.4.
        epsilon_high (Optional[float]): ``log r <= epsilon_high`` for ``A > 0``. Default is None (``epsilon``).
        epsilon_low (Optional[float]): ``log r >= -epsilon_low`` for ``A <= 0``. Default is None
            (``epsilon``).
        **kwargs: the aggregation, KL, entropy and TIS arguments of
            :class:`~torchtune_grpo.loss.base.PolicyGradientLoss`.

    Raises:
        ValueError: on a negative clip range.
    """

    def __init__(
        self, epsilon: float = 0.4, epsilon_high: Optional[float] = None, epsilon_low: Optional[float] = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.epsilon_high = _bound(epsilon if epsilon_high is None else epsilon_high, "epsilon_high")
        self.epsilon_low = _bound(epsilon if epsilon_low is None else epsilon_low, "epsilon_low")

    def formula_lines(self) -> List[str]:
        return [
            "ratio      x_i,t = log pi_theta(o_i,t) - log pi_old(o_i,t), clipped: min(x_i,t, "
            f"{self.epsilon_high:g}) where A_i > 0, max(x_i,t, -{self.epsilon_low:g}) where A_i <= 0",
            "           s_i = exp((1 / |o_i|) * sum_t clipped x_i,t)   [GMPO: geometric mean, clipped in log space]",
            "policy     p_i,t = -A_i * s_i   (the same for every token of sequence i)",
        ]

    def _policy(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> PolicyTerm:
        x = masked_log_ratio(logprobs, old_logprobs, mask)  # [B, T]
        positive = (adv > 0).expand_as(x)
        # Clamping to a constant removes the gradient of exactly the clipped tokens.
        clipped_x = torch.where(positive, x.clamp(max=self.epsilon_high), x.clamp(min=-self.epsilon_low))
        s = torch.exp(clamp_log_ratio(sequence_mean(clipped_x, mask)))  # [B, 1]
        with torch.no_grad():
            clipped = torch.where(positive, x > self.epsilon_high, x < -self.epsilon_low)
        return PolicyTerm(loss=(-adv * s).expand_as(x), ratio=s.detach().expand_as(x), clipped=clipped & mask)


class SAPOLoss(PolicyGradientLoss):
    """SAPO: a smooth, temperature-controlled gate on the token ratio instead of the hard clip.

    Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347:

        p_i,t = -f_i(r_i,t) * A_i,   f_i(r) = (4 / tau_i) * sigmoid(tau_i * (r - 1)),
        tau_i = tau_pos if A_i > 0 else tau_neg

    The gradient is ``-A_i * w * grad log pi`` with ``w = 4 sigma (1 - sigma) r``: 1 on-policy (``r = 1``),
    decaying smoothly as ``r`` leaves 1, and faster for negative advantages with ``tau_neg > tau_pos`` (the
    paper's 1.05 vs 1.0). On-policy the value is ``-2 A_i / tau_i`` (not ``-A_i``). There is no hard clip:
    ``clip_fraction`` is 0.

    Args:
        tau_pos (float): gate temperature for ``A > 0``. Default is 1.0.
        tau_neg (float): gate temperature for ``A <= 0``. Default is 1.05.
        **kwargs: the aggregation, KL, entropy and TIS arguments of
            :class:`~torchtune_grpo.loss.base.PolicyGradientLoss`.

    Raises:
        ValueError: on a temperature ``<= 0``.
    """

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, tau in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if tau <= 0:
                raise ValueError(f"{name} must be > 0, got {tau}")
        self.tau_pos = float(tau_pos)
        self.tau_neg = float(tau_neg)

    def formula_lines(self) -> List[str]:
        return [
            "ratio      r_i,t = pi_theta(o_i,t | q, o_i,<t) / pi_old(o_i,t | q, o_i,<t)   [token level]",
            "policy     p_i,t = -(4 / tau_i) * sigmoid(tau_i * (r_i,t - 1)) * A_i,   "
            f"tau_i = {self.tau_pos:g} where A_i > 0, {self.tau_neg:g} otherwise   [SAPO soft gate, no hard clip]",
        ]

    def _policy(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> PolicyTerm:
        ratio = torch.exp(clamp_log_ratio(masked_log_ratio(logprobs, old_logprobs, mask)))  # [B, T]
        tau = torch.where(adv > 0, torch.full_like(adv, self.tau_pos), torch.full_like(adv, self.tau_neg))  # [B, 1]
        gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
        return PolicyTerm(loss=-gate * adv, ratio=ratio.detach(), clipped=torch.zeros_like(mask))
