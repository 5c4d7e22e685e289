"""Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300, section 4.1.2).

Each prompt is sampled ``G`` times; a completion's advantage is its reward relative to the other
completions of the same prompt, so no value network is needed. The same advantage is used for every token
of the completion (outcome supervision).
"""

from typing import NamedTuple

import torch

__all__ = ["AdvantageOutput", "GroupRelativeAdvantage"]


class AdvantageOutput(NamedTuple):
    """Advantages of ``N = num_groups x G`` completions.

    Attributes:
        advantages (torch.Tensor): one advantage per completion, shape ``[N]``, float32.
        zero_std (torch.Tensor): groups whose rewards are all equal (so they carry no learning signal and
            get exactly zero advantage), shape ``[N // G]``, bool.
    """

    advantages: torch.Tensor
    zero_std: torch.Tensor


class GroupRelativeAdvantage:
    """``A_i = (r_i - mean_g) / (std_g + eps)`` within each group of ``G`` completions of one prompt.

    ``std_g`` is the *sample* (unbiased, Bessel-corrected, ``/(G - 1)``) standard deviation, as in
    DeepSeekMath's GRPO and TRL (``torch.std``). With ``scale_by_std=False`` the advantage is just
    ``r_i - mean_g``, as recommended by Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), which argues that
    dividing by the std over-weights prompts that are almost always or almost never solved.

    A group whose rewards are all equal (``max - min <= 1e-6 * max(1, |mean|)``, so float noise in
    rewards that should be equal does not matter) gets exactly 0 advantage: otherwise ``(r - mean) /
    (0 + eps)`` would blow float noise up by ``1 / eps``. A group of size 1 is always such a group.

    Computation is in float64, the result float32.

    Args:
        scale_by_std (bool): divide by the group's standard deviation. Default is True.
        eps (float): added to the std to bound the scale of low-variance groups. Default is 1e-6.
    """

    def __init__(self, scale_by_std: bool = True, eps: float = 1e-6) -> None:
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.scale_by_std = scale_by_std
        self.eps = eps

    def __call__(self, rewards: torch.Tensor, group_size: int) -> AdvantageOutput:
        """Computes group-relative advantages.

        Args:
            rewards (torch.Tensor): total reward of each completion, shape ``[N]``; completions
                ``g*G .. (g+1)*G - 1`` form group ``g``.
            group_size (int): ``G``, completions per prompt.

        Returns:
            AdvantageOutput: ``advantages [N]`` float32 and ``zero_std [N // G]`` bool, on
            ``rewards.device``.

        Raises:
            ValueError: if ``rewards`` is not 1-D or not finite, ``group_size < 1``, or ``N`` is not a
                multiple of ``group_size``.
        """
        if rewards.dim() != 1:
            raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
        if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        group_size = int(group_size)
        n = rewards.numel()
        if n % group_size != 0:
            raise ValueError(
                f"number of rewards ({n}) is not a multiple of group_size ({group_size}): "
                "each prompt must have exactly group_size completions"
            )
        if n == 0:
            empty = torch.zeros(0, device=rewards.device)
            return AdvantageOutput(advantages=empty, zero_std=empty.bool())
        r = rewards.detach().to(torch.float64).view(n // group_size, group_size)  # [num_groups, G]
        if not torch.isfinite(r).all():
            raise ValueError("rewards must be finite")
        mean = r.mean(dim=1, keepdim=True)  # [num_groups, 1]
        spread = r.amax(dim=1) - r.amin(dim=1)  # [num_groups]
        zero_std = spread <= 1e-6 * mean.squeeze(1).abs().clamp(min=1.0)  # [num_groups]
        adv = r - mean
        if self.scale_by_std and group_size > 1:
            # unbiased=True (correction=1): the sample std, as DeepSeekMath/TRL. G == 1 would give NaN,
            # but such groups are all zero_std and skipped below.
            adv = adv / (r.std(dim=1, keepdim=True, correction=1) + self.eps)
        adv = torch.where(zero_std.unsqueeze(1), torch.zeros_like(adv), adv)
        return AdvantageOutput(advantages=adv.reshape(n).to(torch.float32), zero_std=zero_std)
