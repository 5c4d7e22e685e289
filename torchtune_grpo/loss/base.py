"""What every policy loss of the family shares: aggregation over the global batch, KL term, entropy bonus,
importance weights against the generation engine, validation and metrics.

A subclass states only its policy term ``p_i,t`` (:meth:`PolicyGradientLoss._policy`); the per-token loss is

    l_i,t = p_i,t x w_i,t + kl_coef * k(d_i,t) - entropy_coef * H_i,t

with ``w`` the product of the truncated importance weights against the engine's sampling logprobs (TIS,
``tis_cap``) and of any ``importance_weights`` the caller passes (rollout correction,
:mod:`torchtune_grpo.loss.rollout_correction`), then aggregated by ``loss_agg_mode``.

Normalisation is over the *global* batch (docs/architecture.md, "Loss normalisation"): the caller passes
``num_tokens`` and ``num_seqs`` counted over all micro-batches and all ranks, and each micro-batch returns
its share of the full-batch loss. Summing the returned losses over micro-batches (and all-reducing over
ranks) gives exactly the full-batch loss and gradient, whatever the split, as long as the policy term of a
token depends only on its own sequence (a sequence is never split).
"""

from typing import List, NamedTuple, Optional, Union

import torch
from torch import nn

from torchtune_grpo.loss.kl import KL_ESTIMATORS, MAX_LOG_RATIO, kl_estimate
from torchtune_grpo.loss.rollout_correction import tis_weights
from torchtune_grpo.loss.token_advantages import advantage_columns

__all__ = ["LOSS_AGG_MODES", "LossOutput", "PolicyGradientLoss", "PolicyTerm", "sequence_mean"]

#: Valid ``loss_agg_mode`` values.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class LossOutput(NamedTuple):
    """One micro-batch's share of the global-batch loss and metrics.

    Every field is a contribution: summing a field over all micro-batches (and ranks) gives its value over
    the whole batch.

    Attributes:
        loss (torch.Tensor): scalar with grad; policy loss plus ``kl_coef`` x KL minus ``entropy_coef`` x
            entropy, aggregated by ``loss_agg_mode`` and divided by the global counts.
        policy_loss (torch.Tensor): scalar, detached; the policy term alone, same aggregation as ``loss``.
        kl (torch.Tensor): scalar, detached; ``sum(kl * mask) / num_tokens`` (token mean, whatever the mode)
            with the configured estimator's value; 0 when no ``ref_logprobs`` were given.
        clip_fraction (torch.Tensor): scalar, detached; ``sum(clipped * mask) / num_tokens``; what counts
            as clipped is each loss's own (see its class).
        ratio_mean (torch.Tensor): scalar, detached; ``sum(rho * mask) / num_tokens``.
        entropy (torch.Tensor): scalar, detached; ``sum(H * mask) / num_tokens``; 0 when no ``entropy`` was
            given.
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    clip_fraction: torch.Tensor
    ratio_mean: torch.Tensor
    entropy: torch.Tensor


class PolicyTerm(NamedTuple):
    """A policy loss's per-token output.

    Attributes:
        loss (torch.Tensor): ``p_i,t``, ``[B, T]``, with grad; any value at masked positions (ignored).
        ratio (torch.Tensor): the importance ratio reported as ``ratio_mean``, ``[B, T]``, detached.
        clipped (torch.Tensor): ``[B, T]`` bool, the tokens counted by ``clip_fraction``.
    """

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


def _as_count(n: Union[int, torch.Tensor], like: torch.Tensor) -> Union[float, torch.Tensor]:
    # Counts of 0 (every response empty) would give 0/0 = NaN; the numerators are 0 then, so clamp to 1.
    # A Python int stays a Python number: no host-device copy and no sync.
    if isinstance(n, torch.Tensor):
        return n.to(device=like.device, dtype=like.dtype).clamp(min=1)
    return float(max(n, 1))


def masked_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi - log pi_old`` per token, ``[B, T]``, exactly 0 at masked positions (before any exp)."""
    # Padding may hold garbage (-inf, NaN) that must not reach exp or its backward.
    return torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))


def sequence_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(1 / |o_i|) sum_t values_i,t`` over the masked tokens of each row, ``[B, 1]`` (0 for empty rows).

    ``values`` must already be 0 at masked positions.
    """
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(values.dtype)  # [B, 1]
    return values.sum(dim=-1, keepdim=True) / lengths


class PolicyGradientLoss(nn.Module):
    """Base class: a policy term from :meth:`_policy`, plus KL, entropy, importance weights and aggregation.

    Aggregation modes (``S`` = sum over the micro-batch, ``x_it`` the per-token loss, ``m_it`` the mask,
    ``L_i = sum_t m_it``; ``num_tokens``/``num_seqs`` are global counts):

    - ``"token-mean"``: ``S_it(x_it m_it) / num_tokens``. Every token weighs the same (DAPO).
    - ``"seq-mean-token-mean"``: ``S_i(S_t(x_it m_it) / L_i) / num_seqs``. The original GRPO objective:
      every sequence weighs the same, so tokens of long responses weigh less.
    - ``"seq-mean-token-sum"``: ``S_it(x_it m_it) / num_seqs``.
    - ``"seq-mean-token-sum-norm"``: ``S_it(x_it m_it) / (num_seqs * max_response_length)``. Dr. GRPO
      (Liu et al. 2025, arXiv:2503.20783): a constant normaliser, so no length bias.

    Args:
        kl_coef (float): weight of the KL penalty in the loss; 0 disables it (no reference model needed).
            The recipe sets it from the top-level ``kl_coef`` (0 when the KL is placed in the reward).
            Default is 0.0.
        kl_estimator (str): one of :data:`~torchtune_grpo.loss.kl.KL_ESTIMATORS`. Set by the recipe from the
            top-level ``kl_estimator``. Default is ``"k3"``.
        entropy_coef (float): weight of the entropy bonus (subtracted from the loss); needs the per-token
            ``entropy`` in :meth:`forward`. Default is 0.0.
        loss_agg_mode (str): one of :data:`LOSS_AGG_MODES`. Default is ``"token-mean"``.
        max_response_length (Optional[int]): generation budget in tokens; required by
            ``"seq-mean-token-sum-norm"``. Default is None.
        tis_cap (Optional[float]): truncated importance sampling (Yao et al. 2025,
            https://fengyao.notion.site/off-policy-rl): multiply each token's policy term by
            ``min(pi_old / mu, tis_cap)``, ``mu`` being the generation engine's sampling probability
            (``sampler_logprobs`` in :meth:`forward`; the recipe passes vLLM's). Typically 2. Without
            ``sampler_logprobs`` (the native engine samples from ``pi_old`` itself) it changes nothing.
            The top-level ``rollout_correction`` generalises it. Default is None (off).

    Raises:
        ValueError: on an unknown mode or estimator, a negative coefficient, a ``tis_cap <= 0``, or a
            missing ``max_response_length``.
    """

    def __init__(
        self,
        kl_coef: float = 0.0,
        kl_estimator: str = "k3",
        entropy_coef: float = 0.0,
        loss_agg_mode: str = "token-mean",
        max_response_length: Optional[int] = None,
        tis_cap: Optional[float] = None,
    ) -> None:
        super().__init__()
        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {list(LOSS_AGG_MODES)}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {kl_estimator!r}; valid estimators are {list(KL_ESTIMATORS)}")
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        if entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0 (it is a bonus), got {entropy_coef}")
        if tis_cap is not None and tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or null), got {tis_cap}")
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if max_response_length is None or max_response_length <= 0:
                raise ValueError(
                    "loss_agg_mode='seq-mean-token-sum-norm' needs max_response_length (the generation "
                    f"budget, a positive int), got {max_response_length!r}"
                )
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.entropy_coef = float(entropy_coef)
        self.loss_agg_mode = loss_agg_mode
        self.max_response_length = max_response_length
        self.tis_cap = None if tis_cap is None else float(tis_cap)

    def _policy(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> PolicyTerm:
        """The policy term: ``logprobs``/``old_logprobs [B, T]``, ``adv [B, 1]`` (one per sequence) or
        ``[B, T]`` (one per token, process rewards), ``mask [B, T]`` bool."""
        raise NotImplementedError

    def formula_lines(self) -> List[str]:
        """The ratio and policy term as text lines for the algorithm card (``p_i,t = ...``)."""
        raise NotImplementedError

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
        entropy: Optional[torch.Tensor] = None,
        num_tokens: Union[int, torch.Tensor],
        num_seqs: Union[int, torch.Tensor],
        sampler_logprobs: Optional[torch.Tensor] = None,
        importance_weights: Optional[torch.Tensor] = None,
    ) -> LossOutput:
        """Computes one micro-batch's share of the global loss.

        Args:
            logprobs (torch.Tensor): log-probabilities of the sampled tokens under the current policy, with
                grad, shape ``[B, T]``.
            old_logprobs (torch.Tensor): the same under the policy that sampled them, shape ``[B, T]``
                (treated as constants). Equal to ``logprobs.detach()`` on the first, on-policy update.
            advantages (torch.Tensor): one advantage per sequence, shape ``[B]``, or one per token, shape
                ``[B, T]`` (process-supervised advantages); constants.
            mask (torch.Tensor): True on the tokens trained on, shape ``[B, T]`` bool. Values at other
                positions are ignored (they may be anything, even inf/NaN, in the log-probability inputs).
            ref_logprobs (Optional[torch.Tensor]): log-probabilities under the reference policy, shape
                ``[B, T]`` (constants). Required when ``kl_coef > 0``; when given with ``kl_coef == 0`` the
                KL is still reported as a metric. Default is None.
            entropy (Optional[torch.Tensor]): entropy of the current policy at each position, shape
                ``[B, T]`` (with grad when ``entropy_coef > 0``). Required when ``entropy_coef > 0``;
                otherwise only reported. Default is None.
            num_tokens (Union[int, torch.Tensor]): tokens of ``mask`` over all micro-batches and ranks.
            num_seqs (Union[int, torch.Tensor]): sequences over all micro-batches and ranks of the step,
                empty ones included.
            sampler_logprobs (Optional[torch.Tensor]): the generation engine's log-probabilities of the
                sampled tokens, shape ``[B, T]`` (constants); used for TIS when ``tis_cap`` is set.
                Default is None.
            importance_weights (Optional[torch.Tensor]): ``[B, T]`` constants multiplying each token's policy
                term (the rollout correction's weights, :class:`~torchtune_grpo.loss.rollout_correction.RolloutCorrection`).
                Default is None (1).

        Returns:
            LossOutput: the scaled loss (with grad) and detached metric contributions.

        Raises:
            ValueError: on mismatched shapes, ``kl_coef > 0`` without ``ref_logprobs`` or
                ``entropy_coef > 0`` without ``entropy``.
        """
        if logprobs.dim() != 2:
            raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
        shape = logprobs.shape
        for name, t in (
            ("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs), ("entropy", entropy),
            ("sampler_logprobs", sampler_logprobs), ("importance_weights", importance_weights),
        ):
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
        adv = advantage_columns(advantages, shape)  # [B, 1] or [B, T]; raises on any other shape
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={self.kl_coef} > 0 needs ref_logprobs (or set kl_coef: 0.0)")
        if self.entropy_coef > 0 and entropy is None:
            raise ValueError(f"entropy_coef={self.entropy_coef} > 0 needs the per-token entropy")

        mask = mask.bool()
        n_tok = _as_count(num_tokens, logprobs)
        n_seq = _as_count(num_seqs, logprobs)
        zeros = torch.zeros_like(logprobs)
        adv = adv.detach().to(logprobs.dtype)  # [B, 1] or [B, T]

        term = self._policy(logprobs, old_logprobs, adv, mask)
        policy = term.loss  # [B, T]
        if self.tis_cap is not None and sampler_logprobs is not None:
            # The tokens came from the engine's mu, not pi_old: reweight towards pi_old (truncated).
            policy = policy * tis_weights(old_logprobs, sampler_logprobs, mask, self.tis_cap)
        if importance_weights is not None:
            policy = policy * torch.where(mask, importance_weights.detach().to(policy.dtype), zeros)

        per_token = policy
        if ref_logprobs is not None:
            # Without the penalty the KL is only a metric: keep it out of the autograd graph.
            lp = logprobs if self.kl_coef > 0 else logprobs.detach()
            kl = kl_estimate(lp, ref_logprobs, self.kl_estimator, mask=mask)  # [B, T]
            if self.kl_coef > 0:
                per_token = per_token + self.kl_coef * kl
            kl_metric = torch.where(mask, kl.detach(), zeros).sum() / n_tok
        else:
            kl_metric = zeros.sum()
        if entropy is not None:
            if self.entropy_coef > 0:
                # A bonus: higher entropy lowers the loss. Garbage at padding is masked by _aggregate.
                per_token = per_token - self.entropy_coef * torch.where(mask, entropy, zeros)
            entropy_metric = torch.where(mask, entropy.detach(), zeros).sum() / n_tok
        else:
            entropy_metric = zeros.sum()

        loss = self._aggregate(per_token, mask, n_tok, n_seq)
        with torch.no_grad():
            policy_loss = self._aggregate(policy.detach(), mask, n_tok, n_seq)
            clip_fraction = (term.clipped & mask).sum().to(logprobs.dtype) / n_tok
            ratio_mean = torch.where(mask, term.ratio.detach(), zeros).sum() / n_tok
        return LossOutput(
            loss=loss,
            policy_loss=policy_loss,
            kl=kl_metric.detach(),
            clip_fraction=clip_fraction,
            ratio_mean=ratio_mean.detach(),
            entropy=entropy_metric.detach(),
        )


def clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``log_ratio`` clamped to ``[-20, 20]`` (no gradient beyond), so ``exp`` never overflows."""
    return log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
