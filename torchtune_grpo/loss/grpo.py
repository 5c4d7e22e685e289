"""GRPOLoss: the PPO-clipped policy ratio (token level, or GSPO's sequence level), KL, entropy bonus.

Per response token ``t`` of sequence ``i`` (advantage ``A_i``, ``|o_i|`` response tokens):

    rho_it   = pi(o_it) / pi_old(o_it)                                  ratio_level="token"   (PPO/GRPO)
    rho_it   = s_i = exp(mean_t' (log pi(o_it') - log pi_old(o_it')))   ratio_level="sequence" (GSPO)
    policy_t = -min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i)
               and, with dual_clip = c and A_i < 0, min(policy_t, -c A_i)
               and, with tis_cap = C and an engine's sampling logprobs mu, x min(pi_old / mu, C)   (TIS)
    loss_t   = policy_t + kl_coef * k(d_t) - entropy_coef * H_t,     d_t = log pi_ref(o_it) - log pi(o_it)

then aggregated over the batch by ``loss_agg_mode``. References: PPO (Schulman et al. 2017,
arXiv:1707.06347); GRPO (Shao et al. 2024, arXiv:2402.03300); clip-higher ``eps_high > eps_low`` (DAPO, Yu
et al. 2025, arXiv:2503.14476); dual clip (Ye et al. 2020, arXiv:1912.09729); sequence-level ratio (GSPO,
Zheng et al. 2025, arXiv:2507.18071); constant normaliser (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783);
truncated importance sampling for an engine that samples with other kernels than the trainer's (TIS, Yao et
al. 2025, https://fengyao.notion.site/off-policy-rl; torchtune_grpo/loss/rollout_correction.py);
KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html).

Aggregation, KL, entropy and importance weights are shared with the other policy losses
(:class:`~torchtune_grpo.loss.base.PolicyGradientLoss`). The sequence-level ratio only looks inside one
sequence, and a sequence is never split, so the loss stays independent of micro-batch and process split.
"""

from typing import List, Optional

import torch

from torchtune_grpo.loss.base import PolicyGradientLoss, PolicyTerm, clamp_log_ratio, masked_log_ratio, sequence_mean

__all__ = ["RATIO_LEVELS", "GRPOLoss", "ppo_formula_lines"]

#: Valid ``ratio_level`` values of :class:`GRPOLoss`.
RATIO_LEVELS = ("token", "sequence")


def ppo_formula_lines(
    epsilon_low: float, epsilon_high: float, dual_clip: Optional[float] = None, ratio_level: str = "token"
) -> List[str]:
    """The ratio and the clipped policy term of :class:`GRPOLoss` as algorithm-card lines."""
    if ratio_level == "sequence":
        lines = [
            "ratio      s_i = exp((1 / |o_i|) * sum_t (log pi_theta(o_i,t) - log pi_old(o_i,t)))   "
            "[sequence level, GSPO]; rho_i,t = s_i"
        ]
    else:
        lines = ["ratio      rho_i,t = pi_theta(o_i,t | q, o_i,<t) / pi_old(o_i,t | q, o_i,<t)   [token level]"]
    lines.append(
        f"policy     p_i,t = -min(rho_i,t * A_i, clip(rho_i,t, 1 - {epsilon_low:g}, 1 + {epsilon_high:g}) * A_i)"
    )
    if dual_clip is not None:
        lines.append(f"           and p_i,t = min(p_i,t, -{dual_clip:g} * A_i) where A_i < 0   [dual clip]")
    return lines


class GRPOLoss(PolicyGradientLoss):
    """Clipped GRPO policy loss with optional KL penalty and entropy bonus, normalised over the global batch.

    ``p_i,t = -min(rho A_i, clip(rho, 1 - epsilon_low, 1 + epsilon_high) A_i)``, optionally dual-clipped;
    see :class:`~torchtune_grpo.loss.base.PolicyGradientLoss` for the aggregation modes, KL, entropy and TIS.

    With ``ratio_level="sequence"`` (GSPO) every token of sequence ``i`` carries the same ratio ``s_i``, the
    geometric mean of its token ratios, hence the same policy term ``l_i``; ``"seq-mean-token-mean"`` then
    gives GSPO's objective ``S_i l_i / num_seqs`` exactly (gradient ``-A_i s_i / L_i`` per token where
    unclipped). Other modes reweight the sequences (``"token-mean"`` by length).

    A token counts in ``clip_fraction`` when clipping removes its policy gradient (``A > 0`` and
    ``rho > 1 + eps_high``, ``A < 0`` and ``rho < 1 - eps_low``, or ``A < 0`` and ``rho > dual_clip``).

    Args:
        epsilon (float): clip range, ``1 - epsilon <= rho <= 1 + epsilon``, unless overridden per side.
            Default is 0.2.
        epsilon_high (Optional[float]): upper clip range, ``rho <= 1 + epsilon_high`` (DAPO's clip-higher:
            0.28). Default is None (``epsilon``).
        epsilon_low (Optional[float]): lower clip range, ``rho >= 1 - epsilon_low``. Default is None
            (``epsilon``).
        dual_clip (Optional[float]): ``c > 1``: for ``A < 0`` the per-token loss is at most ``-c A``, so a
            huge ratio on a bad token cannot blow the loss up (Ye et al. 2020, arXiv:1912.09729; verl's
            ``clip_ratio_c``, typically 3). Default is None (off).
        ratio_level (str): ``"token"`` (PPO/GRPO) or ``"sequence"`` (GSPO). Default is ``"token"``.
        **kwargs: ``kl_coef``, ``kl_estimator``, ``entropy_coef``, ``loss_agg_mode``,
            ``max_response_length``, ``tis_cap`` of :class:`~torchtune_grpo.loss.base.PolicyGradientLoss`.

    Raises:
        ValueError: on an unknown ratio level, a negative clip range or a dual clip ``<= 1`` (and the base
            class's errors).
    """

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        epsilon_low: Optional[float] = None,
        dual_clip: Optional[float] = None,
        ratio_level: str = "token",
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if ratio_level not in RATIO_LEVELS:
            raise ValueError(f"unknown ratio_level {ratio_level!r}; valid levels are {list(RATIO_LEVELS)}")
        epsilon_low = epsilon if epsilon_low is None else epsilon_low
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if epsilon_low < 0 or epsilon_high < 0:
            raise ValueError(f"clip ranges must be >= 0, got epsilon_low={epsilon_low}, epsilon_high={epsilon_high}")
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or null), got {dual_clip}")
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.ratio_level = ratio_level

    def formula_lines(self) -> List[str]:
        return ppo_formula_lines(self.epsilon_low, self.epsilon_high, self.dual_clip, self.ratio_level)

    def _log_ratio(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``log rho`` per token, ``[B, T]``: the token's own, or its sequence's mean (GSPO)."""
        log_ratio = masked_log_ratio(logprobs, old_logprobs, mask)
        if self.ratio_level == "sequence":
            # log s_i = (1/L_i) sum_t log rho_it: the log of the geometric mean of the token ratios, i.e.
            # GSPO's length-normalised sequence likelihood ratio. Every token of the row shares it.
            log_ratio = sequence_mean(log_ratio, mask).expand_as(logprobs)
        return clamp_log_ratio(log_ratio)

    def _policy(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> PolicyTerm:
        ratio = torch.exp(self._log_ratio(logprobs, old_logprobs, mask))  # [B, T]
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high) * adv
        policy = -torch.minimum(unclipped, clipped)  # [B, T]
        if self.dual_clip is not None:
            # For A < 0 the PPO term -rho*A grows without bound in rho; cap it at -c*A (no gradient there).
            policy = torch.where(adv < 0, torch.minimum(policy, -self.dual_clip * adv), policy)
        with torch.no_grad():
            # The clipped branch is taken (and the token gets no gradient) only outside the clip range on
            # the side the advantage pushes towards.
            is_clipped = ((adv > 0) & (ratio > 1.0 + self.epsilon_high)) | (
                (adv < 0) & (ratio < 1.0 - self.epsilon_low)
            )
            if self.dual_clip is not None:
                is_clipped |= (adv < 0) & (ratio > self.dual_clip)
        return PolicyTerm(loss=policy, ratio=ratio.detach(), clipped=is_clipped)
