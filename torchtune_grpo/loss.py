"""The GRPO loss: clipped policy-ratio objective plus an optional k3 KL penalty.

Per response token ``t`` of sequence ``i`` (advantage ``A_i``, ratio ``rho = pi(t) / pi_old(t)``):

    policy_t = -min(rho * A_i, clip(rho, 1 - eps_low, 1 + eps_high) * A_i)      (PPO, Schulman et al. 2017,
                                                                                  arXiv:1707.06347; GRPO,
                                                                                  Shao et al. 2024,
                                                                                  arXiv:2402.03300)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                      (k3 estimator of
                                                                                  KL(pi || pi_ref), Schulman,
                                                                                  "Approximating KL
                                                                                  Divergence", 2020)
    loss_t   = policy_t + kl_coef * kl_t

``eps_high > eps_low`` is DAPO's "clip-higher" (Yu et al. 2025, arXiv:2503.14476).

Normalisation is over the *global* batch (docs/architecture.md, "Loss normalisation"): the caller passes
``num_tokens`` and ``num_seqs`` counted over all micro-batches and all ranks, and each micro-batch returns
its share of the full-batch loss. Summing the returned losses over micro-batches (and all-reducing over
ranks) gives exactly the full-batch loss and gradient, whatever the split.
"""

from typing import NamedTuple, Optional, Union

import torch
from torch import nn

__all__ = ["LOSS_AGG_MODES", "GRPOLoss", "LossOutput"]

#: Valid ``loss_agg_mode`` values of :class:`GRPOLoss`.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

# |log ratio| is clamped to this before exp (as verl does): exp(20) ~ 5e8 is already far outside any clip
# range, and an unclamped exp can overflow to inf, whose backward (0 * inf) is NaN even where the token's
# gradient should be 0.
_MAX_LOG_RATIO = 20.0


class LossOutput(NamedTuple):
    """One micro-batch's share of the global-batch loss and metrics.

    Every field is a contribution: summing a field over all micro-batches (and ranks) gives its value over
    the whole batch.

    Attributes:
        loss (torch.Tensor): scalar with grad; policy loss plus ``kl_coef`` x KL, aggregated by
            ``loss_agg_mode`` and divided by the global counts.
        policy_loss (torch.Tensor): scalar, detached; the policy term alone, same aggregation as ``loss``.
        kl (torch.Tensor): scalar, detached; ``sum(kl * mask) / num_tokens`` (token mean, whatever the mode);
            0 when no ``ref_logprobs`` were given.
        clip_fraction (torch.Tensor): scalar, detached; ``sum(clipped * mask) / num_tokens``, where a token
            is clipped when the clipped branch of the min is taken and gives no gradient
            (``A > 0`` and ``rho > 1 + eps_high``, or ``A < 0`` and ``rho < 1 - eps_low``).
        ratio_mean (torch.Tensor): scalar, detached; ``sum(rho * mask) / num_tokens``.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor


def _as_count(n: Union[int, torch.Tensor], like: torch.Tensor) -> Union[float, torch.Tensor]:
    # Counts of 0 (every response empty) would give 0/0 = NaN; the numerators are 0 then, so clamp to 1.
    # A Python int stays a Python number: no host-device copy and no sync.
    if isinstance(n, torch.Tensor):
        return n.to(device=like.device, dtype=like.dtype).clamp(min=1)
    return float(max(n, 1))


class GRPOLoss(nn.Module):
    """Clipped GRPO policy loss with an optional k3 KL penalty, normalised over the global batch.

    Aggregation modes (``S`` = sum over the micro-batch, ``x_it`` the per-token loss, ``m_it`` the mask,
    ``L_i = sum_t m_it``; ``num_tokens``/``num_seqs`` are global counts):

    - ``"token-mean"``: ``S_it(x_it m_it) / num_tokens``. Every token weighs the same (DAPO).
    - ``"seq-mean-token-mean"``: ``S_i(S_t(x_it m_it) / L_i) / num_seqs``. The original GRPO objective:
      every sequence weighs the same, so tokens of long responses weigh less.
    - ``"seq-mean-token-sum"``: ``S_it(x_it m_it) / num_seqs``.
    - ``"seq-mean-token-sum-norm"``: ``S_it(x_it m_it) / (num_seqs * max_response_length)``. Dr. GRPO
      (Liu et al. 2025, arXiv:2503.20783): a constant normaliser, so no length bias.

    Args:
        epsilon (float): lower clip range, ``rho >= 1 - epsilon``. Default is 0.2.
        epsilon_high (Optional[float]): upper clip range, ``rho <= 1 + epsilon_high``. Default is None
            (same as ``epsilon``).
        kl_coef (float): weight of the k3 KL penalty towards the reference policy; 0 disables it (no
            reference model needed). Default is 0.0.
        loss_agg_mode (str): one of :data:`LOSS_AGG_MODES`. Default is ``"token-mean"``.
        max_response_length (Optional[int]): generation budget in tokens; required by
            ``"seq-mean-token-sum-norm"``. Default is None.

    Raises:
        ValueError: on an unknown mode, a negative clip range or coefficient, or a missing
            ``max_response_length``.
    """

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        kl_coef: float = 0.0,
        loss_agg_mode: str = "token-mean",
        max_response_length: Optional[int] = None,
    ) -> None:
        super().__init__()
        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {list(LOSS_AGG_MODES)}")
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if epsilon < 0 or epsilon_high < 0:
            raise ValueError(f"clip ranges must be >= 0, got epsilon={epsilon}, epsilon_high={epsilon_high}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if max_response_length is None or max_response_length <= 0:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' needs max_response_length (the generation "
                    f"budget, a positive int), got {max_response_length!r}"
                )
        self.epsilon_low = float(epsilon)
        self.epsilon_high = float(epsilon_high)
        self.kl_coef = float(kl_coef)
        self.loss_agg_mode = loss_agg_mode
        self.max_response_length = max_response_length

    def _aggregate(
        self,
        per_token: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: Union[float, torch.Tensor],
        num_seqs: Union[float, torch.Tensor],
    ) -> torch.Tensor:
        """Micro-batch share of the global loss: ``per_token [B, T]``, ``mask [B, T]`` bool -> scalar."""
        masked = torch.where(mask, per_token, torch.zeros_like(per_token))  # [B, T]
        mode = self.loss_agg_mode
        if mode == "token-mean":
            return masked.sum() / num_tokens
        if mode == "seq-mean-token-mean":
            # Empty rows (no response tokens) have a zero numerator; clamping their length avoids 0/0.
            lengths = mask.sum(dim=-1).clamp(min=1).to(per_token.dtype)  # [B]
            return (masked.sum(dim=-1) / lengths).sum() / num_seqs
        if mode == "seq-mean-token-sum":
            return masked.sum() / num_seqs
        return masked.sum() / (num_seqs * self.max_response_length)  # seq-mean-token-sum-norm

    def forward(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        *,
        ref_logprobs: Optional[torch.Tensor] = None,
        num_tokens: Union[int, torch.Tensor],
        num_seqs: Union[int, torch.Tensor],
    ) -> LossOutput:
        """Computes one micro-batch's share of the global GRPO loss.

        Args:
            logprobs (torch.Tensor): log-probabilities of the sampled tokens under the current policy, with
                grad, shape ``[B, T]``.
            old_logprobs (torch.Tensor): the same under the policy that sampled them, shape ``[B, T]``
                (treated as constants). Equal to ``logprobs.detach()`` on the first, on-policy update.
            advantages (torch.Tensor): one advantage per sequence, shape ``[B]`` (constants).
            mask (torch.Tensor): True on response tokens, shape ``[B, T]`` bool. Values at other positions
                are ignored (they may be anything, even inf/NaN, in the log-probability inputs).
            ref_logprobs (Optional[torch.Tensor]): log-probabilities under the reference policy, shape
                ``[B, T]`` (constants). Required when ``kl_coef > 0``; when given with ``kl_coef == 0`` the
                KL is still reported as a metric. Default is None.
            num_tokens (Union[int, torch.Tensor]): response tokens (``mask.sum()``) over all
                micro-batches and ranks of the step.
            num_seqs (Union[int, torch.Tensor]): sequences over all micro-batches and ranks of the step,
                empty ones included.

        Returns:
            LossOutput: the scaled loss (with grad) and detached metric contributions.

        Raises:
            ValueError: on mismatched shapes, or ``kl_coef > 0`` without ``ref_logprobs``.
        """
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
        shape = logprobs.shape
        for name, t in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs)):
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
        if advantages.shape != shape[:1]:
            raise ValueError(f"advantages must be [B] = [{shape[0]}], got shape {tuple(advantages.shape)}")
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={self.kl_coef} > 0 needs ref_logprobs (or set kl_coef: 0.0)")

        mask = mask.bool()
        n_tok = _as_count(num_tokens, logprobs)
        n_seq = _as_count(num_seqs, logprobs)
        zeros = torch.zeros_like(logprobs)
        adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # [B, 1]

        # Masked before exp: padding may hold garbage (-inf, NaN) that must not reach exp or its backward.
        log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), zeros)
        log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # [B, T]
        ratio = torch.exp(log_ratio)  # [B, T]
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high) * adv
        policy = -torch.minimum(unclipped, clipped)  # [B, T]

        per_token = policy
        if ref_logprobs is not None:
            # k3 = exp(d) - d - 1 >= 0 with d = log(pi_ref / pi): unbiased for KL(pi || pi_ref) under
            # samples of pi, and never negative, unlike k1 = -d.
            # Without the penalty the KL is only a metric: keep it out of the autograd graph.
            lp = logprobs if self.kl_coef > 0 else logprobs.detach()
            d = torch.where(mask, ref_logprobs.detach() - lp, zeros).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
            kl = torch.exp(d) - d - 1.0  # [B, T]
            if self.kl_coef > 0:
                per_token = policy + self.kl_coef * kl
            kl_metric = torch.where(mask, kl.detach(), zeros).sum() / n_tok
        else:
            kl_metric = zeros.sum()

        loss = self._aggregate(per_token, mask, n_tok, n_seq)
        with torch.no_grad():
            policy_loss = self._aggregate(policy.detach(), mask, n_tok, n_seq)
            # The clipped branch is taken (and the token gets no gradient) only outside the clip range on
            # the side the advantage pushes towards.
            is_clipped = ((adv > 0) & (ratio > 1.0 + self.epsilon_high)) | (
                (adv < 0) & (ratio < 1.0 - self.epsilon_low)
            )
            clip_fraction = (is_clipped & mask).sum().to(logprobs.dtype) / n_tok
            ratio_mean = torch.where(mask, ratio, zeros).sum() / n_tok
        return LossOutput(
            loss=loss,
            policy_loss=policy_loss,
            kl=kl_metric.detach(),
            clip_fraction=clip_fraction,
            ratio_mean=ratio_mean.detach(),
        )
