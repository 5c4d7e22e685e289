"""The GRPO loss family: clipped policy ratio, KL to a reference policy, entropy bonus.

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
al. 2025, https://fengyao.notion.site/off-policy-rl; torchtune_grpo/offpolicy.py);
KL estimators k1/k2/k3 (Schulman 2020, "Approximating KL Divergence",
http://joschu.net/blog/kl-approx.html).

Normalisation is over the *global* batch (docs/architecture.md, "Loss normalisation"): the caller passes
``num_tokens`` and ``num_seqs`` counted over all micro-batches and all ranks, and each micro-batch returns
its share of the full-batch loss. Summing the returned losses over micro-batches (and all-reducing over
ranks) gives exactly the full-batch loss and gradient, whatever the split. The sequence-level ratio only
looks inside one sequence, and a sequence is never split, so it keeps that property.
"""

from typing import NamedTuple, Optional, Union

import torch
from torch import nn

from torchtune_grpo.offpolicy import tis_weights

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "RATIO_LEVELS",
    "GRPOLoss",
    "LossOutput",
    "kl_estimate",
    "kl_reward_penalty",
]

#: Valid ``loss_agg_mode`` values of :class:`GRPOLoss`.
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
#: Valid ``kl_estimator`` values: see :func:`kl_estimate`.
KL_ESTIMATORS = ("k1", "k2", "k3", "k3+")
#: Valid ``ratio_level`` values of :class:`GRPOLoss`.
RATIO_LEVELS = ("token", "sequence")

# |log ratio| is clamped to this before exp (as verl does): exp(20) ~ 5e8 is already far outside any clip
# range, and an unclamped exp can overflow to inf, whose backward (0 * inf) is NaN even where the token's
# gradient should be 0.
_MAX_LOG_RATIO = 20.0


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
    d = d.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
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
        clip_fraction (torch.Tensor): scalar, detached; ``sum(clipped * mask) / num_tokens``, where a token
            is clipped when clipping removes its policy gradient (``A > 0`` and ``rho > 1 + eps_high``,
            ``A < 0`` and ``rho < 1 - eps_low``, or ``A < 0`` and ``rho > dual_clip``).
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


def _as_count(n: Union[int, torch.Tensor], like: torch.Tensor) -> Union[float, torch.Tensor]:
    # Counts of 0 (every response empty) would give 0/0 = NaN; the numerators are 0 then, so clamp to 1.
    # A Python int stays a Python number: no host-device copy and no sync.
    if isinstance(n, torch.Tensor):
        return n.to(device=like.device, dtype=like.dtype).clamp(min=1)
    return float(max(n, 1))


class GRPOLoss(nn.Module):
    """Clipped GRPO policy loss with optional KL penalty and entropy bonus, normalised over the global batch.

    Aggregation modes (``S`` = sum over the micro-batch, ``x_it`` the per-token loss, ``m_it`` the mask,
    ``L_i = sum_t m_it``; ``num_tokens``/``num_seqs`` are global counts):

    - ``"token-mean"``: ``S_it(x_it m_it) / num_tokens``. Every token weighs the same (DAPO).
    - ``"seq-mean-token-mean"``: ``S_i(S_t(x_it m_it) / L_i) / num_seqs``. The original GRPO objective:
      every sequence weighs the same, so tokens of long responses weigh less.
    - ``"seq-mean-token-sum"``: ``S_it(x_it m_it) / num_seqs``.
    - ``"seq-mean-token-sum-norm"``: ``S_it(x_it m_it) / (num_seqs * max_response_length)``. Dr. GRPO
      (Liu et al. 2025, arXiv:2503.20783): a constant normaliser, so no length bias.

    With ``ratio_level="sequence"`` (GSPO) every token of sequence ``i`` carries the same ratio ``s_i``, the
    geometric mean of its token ratios, hence the same policy term ``l_i``; ``"seq-mean-token-mean"`` then
    gives GSPO's objective ``S_i l_i / num_seqs`` exactly (gradient ``-A_i s_i / L_i`` per token where
    unclipped). Other modes reweight the sequences (``"token-mean"`` by length).

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
        kl_coef (float): weight of the KL penalty in the loss; 0 disables it (no reference model needed).
            The recipe sets it from the top-level ``kl_coef`` (0 when the KL is placed in the reward).
            Default is 0.0.
        kl_estimator (str): one of :data:`KL_ESTIMATORS` (see :func:`kl_estimate`). Set by the recipe
            from the top-level ``kl_estimator``. Default is ``"k3"``.
        entropy_coef (float): weight of the entropy bonus (subtracted from the loss); needs the per-token
            ``entropy`` in :meth:`forward`. Default is 0.0.
        loss_agg_mode (str): one of :data:`LOSS_AGG_MODES`. Default is ``"token-mean"``.
        max_response_length (Optional[int]): generation budget in tokens; required by
            ``"seq-mean-token-sum-norm"``. Default is None.
        tis_cap (Optional[float]): truncated importance sampling: multiply each token's policy term by
            ``min(pi_old / mu, tis_cap)``, ``mu`` being the generation engine's sampling probability
            (``sampler_logprobs`` in :meth:`forward`; the recipe passes vLLM's). Typically 2. Without
            ``sampler_logprobs`` (the native engine samples from ``pi_old`` itself) it changes nothing.
            Default is None (off).

    Raises:
        ValueError: on an unknown mode, estimator or ratio level, a negative clip range or coefficient, a
            dual clip ``<= 1``, a ``tis_cap <= 0``, or a missing ``max_response_length``.
    """

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: Optional[float] = None,
        epsilon_low: Optional[float] = None,
        dual_clip: Optional[float] = None,
        ratio_level: str = "token",
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
        if ratio_level not in RATIO_LEVELS:
            raise ValueError(f"unknown ratio_level {ratio_level!r}; valid levels are {list(RATIO_LEVELS)}")
        epsilon_low = epsilon if epsilon_low is None else epsilon_low
        epsilon_high = epsilon if epsilon_high is None else epsilon_high
        if epsilon_low < 0 or epsilon_high < 0:
            raise ValueError(f"clip ranges must be >= 0, got epsilon_low={epsilon_low}, epsilon_high={epsilon_high}")
        if dual_clip is not None and dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (or null), got {dual_clip}")
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
        self.epsilon_low = float(epsilon_low)
        self.epsilon_high = float(epsilon_high)
        self.dual_clip = None if dual_clip is None else float(dual_clip)
        self.ratio_level = ratio_level
        self.kl_coef = float(kl_coef)
        self.kl_estimator = kl_estimator
        self.entropy_coef = float(entropy_coef)
        self.loss_agg_mode = loss_agg_mode
        self.max_response_length = max_response_length
        self.tis_cap = None if tis_cap is None else float(tis_cap)

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

    def _log_ratio(self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``log rho`` per token, ``[B, T]``: the token's own, or its sequence's mean (GSPO)."""
        # Masked before exp: padding may hold garbage (-inf, NaN) that must not reach exp or its backward.
        log_ratio = torch.where(mask, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
        if self.ratio_level == "sequence":
            # log s_i = (1/L_i) sum_t log rho_it: the log of the geometric mean of the token ratios, i.e.
            # GSPO's length-normalised sequence likelihood ratio. Every token of the row shares it.
            lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1).to(logprobs.dtype)  # [B, 1]
            log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / lengths).expand_as(logprobs)
        return log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)

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
            entropy (Optional[torch.Tensor]): entropy of the current policy at each position, shape
                ``[B, T]`` (with grad when ``entropy_coef > 0``). Required when ``entropy_coef > 0``;
                otherwise only reported. Default is None.
            num_tokens (Union[int, torch.Tensor]): response tokens (``mask.sum()``) over all
                micro-batches and ranks of the step.
            num_seqs (Union[int, torch.Tensor]): sequences over all micro-batches and ranks of the step,
                empty ones included.
            sampler_logprobs (Optional[torch.Tensor]): the generation engine's log-probabilities of the
                sampled tokens, shape ``[B, T]`` (constants); used for TIS when ``tis_cap`` is set.
                Default is None.

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
            ("sampler_logprobs", sampler_logprobs),
        ):
            if t is not None and t.shape != shape:
                raise ValueError(f"{name} must have the shape of logprobs {tuple(shape)}, got {tuple(t.shape)}")
        if advantages.shape != shape[:1]:
            raise ValueError(f"advantages must be [B] = [{shape[0]}], got shape {tuple(advantages.shape)}")
        if self.kl_coef > 0 and ref_logprobs is None:
            raise ValueError(f"kl_coef={self.kl_coef} > 0 needs ref_logprobs (or set kl_coef: 0.0)")
        if self.entropy_coef > 0 and entropy is None:
            raise ValueError(f"entropy_coef={self.entropy_coef} > 0 needs the per-token entropy")

        mask = mask.bool()
        n_tok = _as_count(num_tokens, logprobs)
        n_seq = _as_count(num_seqs, logprobs)
        zeros = torch.zeros_like(logprobs)
        adv = advantages.detach().to(logprobs.dtype).unsqueeze(-1)  # [B, 1]

        ratio = torch.exp(self._log_ratio(logprobs, old_logprobs, mask))  # [B, T]
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - self.epsilon_low, 1.0 + self.epsilon_high) * adv
        policy = -torch.minimum(unclipped, clipped)  # [B, T]
        if self.dual_clip is not None:
            # For A < 0 the PPO term -rho*A grows without bound in rho; cap it at -c*A (no gradient there).
            policy = torch.where(adv < 0, torch.minimum(policy, -self.dual_clip * adv), policy)
        if self.tis_cap is not None and sampler_logprobs is not None:
            # The tokens came from the engine's mu, not pi_old: reweight towards pi_old (truncated).
            policy = policy * tis_weights(old_logprobs, sampler_logprobs, mask, self.tis_cap)

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
            # The clipped branch is taken (and the token gets no gradient) only outside the clip range on
            # the side the advantage pushes towards.
            is_clipped = ((adv > 0) & (ratio > 1.0 + self.epsilon_high)) | (
                (adv < 0) & (ratio < 1.0 - self.epsilon_low)
            )
            if self.dual_clip is not None:
                is_clipped |= (adv < 0) & (ratio > self.dual_clip)
            clip_fraction = (is_clipped & mask).sum().to(logprobs.dtype) / n_tok
            ratio_mean = torch.where(mask, ratio, zeros).sum() / n_tok
        return LossOutput(
            loss=loss,
            policy_loss=policy_loss,
            kl=kl_metric.detach(),
            clip_fraction=clip_fraction,
            ratio_mean=ratio_mean.detach(),
            entropy=entropy_metric.detach(),
        )
