"""Off-policy correction for a generation engine whose sampling probabilities differ from the trainer's.

An engine such as vLLM samples with its own kernels (and, in bf16, its own rounding), so the probability
``mu(o_t)`` it sampled a token with is not exactly the trainer's ``pi_old(o_t)`` for the same weights. The
policy-gradient estimate assumes samples from ``pi_old``; truncated importance sampling (TIS; Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl) reweights each token's policy loss by

    w_t = min(pi_old(o_t) / mu(o_t), C)

(``C`` the cap, typically 2), which corrects the mismatch in expectation while the cap bounds the
variance. :class:`RolloutCorrection` generalises it (token or sequence level, truncated or masked,
one- or two-sided bounds, off-policy sequence masking). These helpers are pure: ``[B, T]`` tensors in,
``[B, T]`` tensors or sums out.
"""

from typing import Dict, List, Mapping, NamedTuple, Optional

import torch

from torchtune_grpo.metrics.sums import Key, Mean, Metric, StepSums
from torchtune_grpo.loss.token_advantages import sequence_advantages

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "CorrectionOutput",
    "RolloutCorrection",
    "CORRECTION_METRICS",
    "correction_metrics",
    "logprob_mismatch_sum",
    "off_policy_note",
    "tis_weights",
]

# |log ratio| is clamped before exp, as in loss/base.py: exp(20) is far above any useful cap.
_MAX_LOG_RATIO = 20.0


def tis_weights(
    old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, cap: float
) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old - sampler), cap)`` per token, detached.

    Args:
        old_logprobs (torch.Tensor): the trainer's ``log pi_old`` of the sampled tokens, ``[B, T]``.
        sampler_logprobs (torch.Tensor): the engine's ``log mu`` of the same tokens, ``[B, T]``.
        mask (torch.Tensor): True on response tokens, ``[B, T]`` bool; other positions get weight 1 (they
            may hold anything, even NaN, in the inputs).
        cap (float): the truncation ``C > 0``.

    Returns:
        torch.Tensor: ``[B, T]`` weights in ``(0, cap]``, no gradient.
    """
    log_w = torch.where(
        mask.bool(), old_logprobs.detach() - sampler_logprobs.detach(), torch.zeros_like(old_logprobs)
    )
    return torch.exp(log_w.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)).clamp(max=cap)


def logprob_mismatch_sum(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``sum |log pi - log mu|`` over response tokens (divide by the token count for the mean).

    The recipe logs the global token mean as ``generation/logprob_mismatch``: 0 for an engine that
    samples exactly from the trainer's distribution, about 1e-6 for vLLM in fp32 on CPU, more in bf16.

    Args:
        trainer_logprobs (torch.Tensor): ``[B, T]``.
        sampler_logprobs (torch.Tensor): ``[B, T]``.
        mask (torch.Tensor): ``[B, T]`` bool, True on response tokens.

    Returns:
        torch.Tensor: a 0-d float64 sum (detached).
    """
    diff = (trainer_logprobs.detach().double() - sampler_logprobs.detach().double()).abs()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff)).sum()


def off_policy_note(tis_cap: Optional[float], engine_name: str, engine_samples_own_logprobs: bool) -> Optional[str]:
    """What a run does about the engine/trainer mismatch when it is not the obvious thing, for the setup log.

    Args:
        tis_cap (Optional[float]): the loss's ``tis_cap`` (None: no TIS, or a loss without it).
        engine_name (str): the engine's class name.
        engine_samples_own_logprobs (bool): whether the engine samples with its own copy of the weights and
            returns its sampling logprobs (``holds_weights``: vLLM).

    Returns:
        Optional[str]: the note, or None when TIS is on with such an engine, or off with the native one.
    """
    if engine_samples_own_logprobs and tis_cap is None:
        return (
            f"Off-policy correction: none. {engine_name} samples with its own kernels, but the loss has no "
            "tis_cap, so its sampling logprobs only feed generation/logprob_mismatch. Set loss.tis_cap "
            "(e.g. 2.0) for truncated importance sampling."
        )
    if not engine_samples_own_logprobs and tis_cap is not None:
        return (
            f"Off-policy correction: loss.tis_cap={tis_cap:g} has no effect: {engine_name} samples with the "
            "trainer's own model and returns no separate sampling logprobs (pi_old / mu = 1)."
        )
    return None


#: Valid ``level`` values of :class:`RolloutCorrection`.
CORRECTION_LEVELS = ("token", "sequence")
#: Valid ``mode`` values of :class:`RolloutCorrection` (None: no importance weights).
CORRECTION_MODES = ("truncate", "mask")


class CorrectionOutput(NamedTuple):
    """What :class:`RolloutCorrection` decided for one rank's rows, before the update.

    Attributes:
        weights (torch.Tensor): ``[B, T]`` float32 importance weight of every token (1 without weighting, 0
            where masked); the loss multiplies each token's policy term by it.
        mask (torch.Tensor): ``[B, T]`` bool, the input mask minus the tokens that leave the loss.
        kept (torch.Tensor): ``[B]`` bool, False for sequences that leave the loss (and the sequence count).
        sums (StepSums): quantities over this rank's rows, ``("rollout_correction", ...)``
            (:data:`CORRECTION_METRICS` turns them, reduced over ranks, into the logged fractions).
    """

    weights: torch.Tensor
    mask: torch.Tensor
    kept: torch.Tensor
    sums: StepSums


class RolloutCorrection:
    """Importance weights and masks against the generation engine's sampling distribution ``mu``.

    ``w = pi_old / mu`` per token (``level: token``), or its geometric mean over the sequence's tokens,
    ``w_i = exp((1 / |o_i|) sum_t (log pi_old - log mu))`` (``level: sequence``, every token of the sequence
    sharing it). Then, with bounds ``[lower, upper]`` (``lower`` None: one-sided):

    - ``mode: truncate`` (TIS, Yao et al. 2025, https://fengyao.notion.site/off-policy-rl): weight
      ``clip(w, lower, upper)``; nothing leaves the loss.
    - ``mode: mask`` (MIS, masked importance sampling, Liu, Yao et al. 2025, "When Speed Kills Stability",
      https://yingru.notion.site/When-Speed-Kills-Stability-Demystifying-RL-Collapse-from-the-Training-Inference-Mismatch-271211a558b7808d8b12d403fd15edda;
      two-sided as IcePop, Ling Team 2025, "Every Step Evolves", arXiv:2510.18855): weight ``w`` where
      ``lower <= w <= upper``; a token (``level: token``) or a whole sequence (``level: sequence``) outside
      leaves the loss.
    - ``mode: null``: no weights (only the off-policy sequence mask below).

    Off-policy sequence masking (OPSM, DeepSeek-AI 2025, "DeepSeek-V3.2", arXiv:2512.02556): with
    ``offpolicy_threshold = delta``, a sequence with ``A_i < 0`` and ``(1 / |o_i|) sum_t (log mu - log pi_old)
    > delta`` leaves the loss. DeepSeek measures the divergence against the policy being trained; here it is
    ``pi_old`` (the same on the first update of a step), so that every mask is decided before the update
    and the global token and sequence counts are known before it (split independence).

    Everything depends only on ``pi_old``, ``mu`` and the advantages, all fixed before the update: the recipe
    applies the masks, *then* counts tokens and sequences over all ranks, so the loss normalisation stays
    independent of micro-batch size and process count. Masked tokens leave ``num_tokens`` (and the
    per-sequence lengths of ``seq-mean-token-mean``); masked sequences also leave ``num_seqs``; a sequence
    all of whose tokens a token-level mask removed stays in ``num_seqs`` (like an empty response).

    Args:
        level (str): ``"token"`` or ``"sequence"`` (geometric mean). Default is ``"token"``.
        mode (Optional[str]): ``"truncate"``, ``"mask"`` or None. Default is ``"truncate"``.
        upper (Optional[float]): upper bound on ``w`` (> 1, typically 2); required by ``truncate`` and
            ``mask``. Default is 2.0.
        lower (Optional[float]): lower bound on ``w`` (in ``(0, 1)``, e.g. 0.5); None for one-sided.
            Default is None.
        offpolicy_threshold (Optional[float]): OPSM's ``delta`` (>= 0); None: off. Default is None.

    Raises:
        ValueError: on an unknown level or mode, bounds outside the ranges above, or a correction that does
            nothing.
    """

    def __init__(
        self,
        level: str = "token",
        mode: Optional[str] = "truncate",
        upper: Optional[float] = 2.0,
        lower: Optional[float] = None,
        offpolicy_threshold: Optional[float] = None,
    ) -> None:
        if level not in CORRECTION_LEVELS:
            raise ValueError(f"rollout_correction.level must be one of {list(CORRECTION_LEVELS)}, got {level!r}")
        if mode is not None and mode not in CORRECTION_MODES:
            raise ValueError(f"rollout_correction.mode must be one of {list(CORRECTION_MODES)} or null, got {mode!r}")
        if mode is not None and (upper is None or upper <= 1.0):
            raise ValueError(f"rollout_correction.upper must be > 1 with mode {mode!r}, got {upper!r}")
        if lower is not None and not 0.0 < lower < 1.0:
            raise ValueError(f"rollout_correction.lower must be in (0, 1) (or null), got {lower!r}")
        if offpolicy_threshold is not None and offpolicy_threshold < 0:
            raise ValueError(f"rollout_correction.offpolicy_threshold must be >= 0, got {offpolicy_threshold}")
        if mode is None and offpolicy_threshold is None:
            raise ValueError("rollout_correction with mode: null needs offpolicy_threshold (else it does nothing)")
        self.level = level
        self.mode = mode
        self.upper = None if upper is None else float(upper)
        self.lower = None if lower is None else float(lower)
        self.offpolicy_threshold = None if offpolicy_threshold is None else float(offpolicy_threshold)

    def formula_lines(self) -> List[str]:
        """The correction as algorithm-card lines."""
        lines = []
        if self.mode is not None:
            if self.level == "token":
                w = "w_i,t = pi_old(o_i,t) / mu(o_i,t)"
            else:
                w = "w_i,t = w_i = exp((1 / |o_i|) * sum_t (log pi_old(o_i,t) - log mu(o_i,t)))   [geometric mean]"
            lines.append(f"rollout    {w},  mu = the generation engine's sampling probability")
            low = "0" if self.lower is None else f"{self.lower:g}"
            if self.mode == "truncate":
                lines.append(f"           p_i,t times clip(w_i,t, {low}, {self.upper:g})   [truncated importance sampling]")
            else:
                what = "the token" if self.level == "token" else "the whole sequence"
                lines.append(
                    f"           p_i,t times w_i,t where {low} <= w_i,t <= {self.upper:g}; outside, {what} "
                    "leaves the loss and the counts   [masked importance sampling]"
                )
        if self.offpolicy_threshold is not None:
            lines.append(
                f"           sequences with A_i < 0 and (1 / |o_i|) * sum_t (log mu - log pi_old) > "
                f"{self.offpolicy_threshold:g} leave the loss and the counts   [off-policy sequence masking]"
            )
        return lines

    @torch.no_grad()
    def __call__(
        self,
        old_logprobs: torch.Tensor,
        sampler_logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
    ) -> CorrectionOutput:
        """Weights and masks for one rank's rows.

        Args:
            old_logprobs (torch.Tensor): the trainer's ``log pi_old``, ``[B, T]``.
            sampler_logprobs (torch.Tensor): the engine's ``log mu``, ``[B, T]``.
            mask (torch.Tensor): ``[B, T]`` bool, the tokens that would be trained on.
            advantages (torch.Tensor): ``[B]``, or ``[B, T]`` (token-level: a sequence's sign is that of
                its token mean over ``mask``).

        Returns:
            CorrectionOutput: weights, the reduced mask, the kept sequences and metric sums.
        """
        mask = mask.bool()
        log_w_tok = log_w_token(old_logprobs, sampler_logprobs, mask)  # [B, T], 0 outside the mask
        zeros = torch.zeros_like(log_w_tok)
        mean_log_w = log_w_tok.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # [B]: log of the geometric mean
        log_w = log_w_tok
        if self.level == "sequence":
            log_w = torch.where(mask, mean_log_w.unsqueeze(-1).expand_as(log_w_tok), zeros)
        w = torch.exp(log_w)  # [B, T], 1 outside the mask
        outside = torch.zeros_like(mask)
        if self.upper is not None:
            outside |= w > self.upper
        if self.lower is not None:
            outside |= w < self.lower
        outside &= mask
        kept = torch.ones_like(mask[:, 0])  # [B]
        token_keep = torch.ones_like(mask)
        truncated = torch.zeros_like(mask)
        weights = torch.ones_like(w)
        if self.mode == "truncate":
            weights, truncated = w.clamp(min=self.lower, max=self.upper), outside
        elif self.mode == "mask":
            weights = w
            if self.level == "sequence":
                kept &= ~outside.any(dim=-1)
            else:
                token_keep = ~outside
        if self.offpolicy_threshold is not None:
            # (1/|o_i|) sum_t (log mu - log pi_old) = -mean log w; only negative-advantage sequences leave.
            seq_adv = sequence_advantages(advantages.to(w.device), mask)  # [B]
            kept &= ~((seq_adv < 0) & (-mean_log_w > self.offpolicy_threshold))
        new_mask = mask & token_keep & kept.unsqueeze(-1)
        has_tokens = mask.any(dim=-1)
        # KL(mu || pi_old) from tokens sampled from mu: k3 with r = pi_old / mu, r - 1 - log r (>= 0).
        kl = torch.where(mask, torch.expm1(log_w_tok) - log_w_tok, zeros)
        sums = StepSums()
        for name, value in (
            ("tokens", mask.sum().item()),
            ("masked", (mask & ~new_mask).sum().item()),
            ("truncated", (truncated & new_mask).sum().item()),
            ("seqs", has_tokens.sum().item()),
            ("seq_masked", (has_tokens & ~kept).sum().item()),
            ("kl", kl.double().sum().item()),
        ):
            sums.add(("rollout_correction", name), value)
        return CorrectionOutput(weights=torch.where(new_mask, weights, zeros), mask=new_mask, kept=kept, sums=sums)


def log_w_token(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old - log mu`` per token, ``[B, T]`` float32, 0 outside ``mask``, clamped to ``[-20, 20]``."""
    diff = (old_logprobs.detach() - sampler_logprobs.detach()).float()
    return torch.where(mask.bool(), diff, torch.zeros_like(diff)).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


_RC = "rollout_correction"

#: The logged rollout-correction metrics, from :attr:`CorrectionOutput.sums` reduced over ranks:
#: ``masked_fraction`` (tokens that left the loss, of the response tokens), ``truncated_fraction`` (tokens
#: whose weight was truncated), ``seq_masked_fraction`` (sequences that left the loss), ``kl`` (token mean of
#: the k3 estimate of ``KL(mu || pi_old)``).
CORRECTION_METRICS: Dict[str, Metric] = {
    f"{_RC}/masked_fraction": Mean((_RC, "masked"), (_RC, "tokens")),
    f"{_RC}/truncated_fraction": Mean((_RC, "truncated"), (_RC, "tokens")),
    f"{_RC}/seq_masked_fraction": Mean((_RC, "seq_masked"), (_RC, "seqs")),
    f"{_RC}/kl": Mean((_RC, "kl"), (_RC, "tokens")),
}


def correction_metrics(reduced: "Mapping[Key, float] | StepSums") -> Dict[str, float]:
    """:data:`CORRECTION_METRICS` of ``reduced`` (empty when it has no rollout-correction quantities)."""
    if (_RC, "tokens") not in reduced:
        return {}
    return {name: metric.value(reduced) for name, metric in CORRECTION_METRICS.items()}
