"""Off-policy correction for a generation engine whose sampling probabilities differ from the trainer's.

An engine such as vLLM samples with its own kernels (and, in bf16, its own rounding), so the probability
``mu(o_t)`` it sampled a token with is not exactly the trainer's ``pi_old(o_t)`` for the same weights. The
policy-gradient estimate assumes samples from ``pi_old``; truncated importance sampling (TIS; Yao et al.
2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl) reweights each token's policy loss by

    w_t = min(pi_old(o_t) / mu(o_t), C)

(``C`` the cap, typically 2), which corrects the mismatch in expectation while the cap bounds the
variance. These helpers are pure: ``[B, T]`` tensors in, ``[B, T]`` tensors or sums out.
"""

from typing import Optional

import torch

__all__ = ["logprob_mismatch_sum", "off_policy_note", "tis_weights"]

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
