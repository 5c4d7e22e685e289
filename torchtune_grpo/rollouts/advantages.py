"""Advantage estimators for outcome rewards: one advantage per completion, shared by all its tokens.

Each prompt is sampled ``G`` times; a completion's advantage is its reward relative to the other
completions of the same prompt, so no value network is needed (GRPO, Shao et al. 2024, arXiv:2402.03300,
section 4.1.2). Every estimator has the same call signature,
``estimator(rewards [N], group_size) -> AdvantageOutput``, and is chosen in YAML::

    advantage:
      _component_: torchtune_grpo.rollouts.advantages.RLOOAdvantage
      clip: 5.0

Estimators are pure. One that needs statistics over the *global* batch (all ranks) declares
``uses_batch_stats = True``; the recipe then all-reduces :meth:`RewardStats.of` over ranks and passes the sum
as ``batch_stats=``, so the result does not depend on how the batch is split over processes.
"""

import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from torchtune_grpo.metrics.sums import StepSums

__all__ = [
    "AdvantageEstimator",
    "AdvantageOutput",
    "BatchStdAdvantage",
    "ComponentNormalization",
    "GroupRelativeAdvantage",
    "RLOOAdvantage",
    "RewardStats",
    "advantage_signal",
    "normalize_components",
    "zero_variance_groups",
]

# A group is "all equal" when its rewards spread by at most this, relative to max(1, |mean|): rewards that
# should be equal but went through different float paths (0.1 + 0.2 vs 0.3) still count as equal.
ZERO_VARIANCE_RTOL = 1e-6


class AdvantageOutput(NamedTuple):
    """Advantages of ``N = num_groups x G`` completions.

    Attributes:
        advantages (torch.Tensor): one advantage per completion, shape ``[N]``, float32.
        zero_std (torch.Tensor): groups whose rewards are all equal (so they carry no learning signal and
            get exactly zero advantage), shape ``[N // G]``, bool.
    """

    advantages: torch.Tensor
    zero_std: torch.Tensor


class RewardStats(NamedTuple):
    """Sufficient statistics of a set of rewards; sums over ranks give those of the global batch.

    Attributes:
        count (float): number of rewards.
        total (float): their sum.
        total_sq (float): the sum of their squares.
    """

    count: float
    total: float
    total_sq: float

    @classmethod
    def of(cls, rewards: torch.Tensor) -> "RewardStats":
        """Statistics of ``rewards`` (any shape), computed in float64."""
        r = rewards.detach().to(torch.float64)
        return cls(float(r.numel()), r.sum().item(), (r * r).sum().item())

    @property
    def std(self) -> float:
        """Sample (Bessel-corrected) standard deviation; 0 for fewer than two rewards."""
        if self.count < 2:
            return 0.0
        mean = self.total / self.count
        var = (self.total_sq - self.count * mean * mean) / (self.count - 1)
        return math.sqrt(max(var, 0.0))  # rounding can make a zero variance slightly negative


def _validate(rewards: torch.Tensor, group_size: int) -> int:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if rewards.numel() % int(group_size) != 0:
        raise ValueError(
            f"number of rewards ({rewards.numel()}) is not a multiple of group_size ({group_size}): "
            "each prompt must have exactly group_size completions"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    return int(group_size)


def zero_variance_groups(rewards: torch.Tensor, group_size: int, rtol: float = ZERO_VARIANCE_RTOL) -> torch.Tensor:
    """Groups whose rewards are all equal, robust to float noise.

    A group is zero-variance when ``max - min <= rtol * max(1, |mean|)``: ``[0.3, 0.1 + 0.2]`` (a spread of
    5.6e-17) is, ``[1e7, 1e7 + 1e-3]`` is (relative tolerance), ``[0, 1e-3]`` is not. A group of one is.
    Used for zero advantages here and by DAPO's dynamic sampling (:mod:`torchtune_grpo.rollouts.group_selection`).

    Args:
        rewards (torch.Tensor): ``[N]``; completions ``g*G .. (g+1)*G - 1`` form group ``g``.
        group_size (int): ``G``.
        rtol (float): relative tolerance. Default is 1e-6.

    Returns:
        torch.Tensor: ``[N // G]`` bool, on ``rewards.device``.
    """
    group_size = _validate(rewards, group_size)
    r = rewards.detach().to(torch.float64).view(-1, group_size)  # [num_groups, G]
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device)
    spread = r.amax(dim=1) - r.amin(dim=1)
    return spread <= rtol * r.mean(dim=1).abs().clamp(min=1.0)


class ComponentNormalization(NamedTuple):
    """Reward components normalised within their groups, then weighted and summed (GDPO).

    Attributes:
        rewards (torch.Tensor): ``[N]`` float32, ``sum_k w_k z_k``: the signal the estimator then takes as
            its rewards.
        per_component (Dict[str, torch.Tensor]): ``w_k z_k`` of each component, ``[N]`` float32.
        zero_std (Dict[str, torch.Tensor]): per component, ``[N // G]`` bool, groups where it is constant.
    """

    rewards: torch.Tensor
    per_component: Dict[str, torch.Tensor]
    zero_std: Dict[str, torch.Tensor]

    def sums(self) -> StepSums:
        """This rank's quantities for the ``advantage/<name>/*`` metrics: per component its sum, sum of
        squares and zero-variance groups (``("advantage", name, ...)``), and the groups counted."""
        out = StepSums()
        for name, a in self.per_component.items():
            a = a.double()
            out.add(("advantage", name, "sum"), a.sum().item())
            out.add(("advantage", name, "sq"), (a * a).sum().item())
            out.add(("advantage", name, "zero_std"), self.zero_std[name].sum().item())
        groups = next(iter(self.zero_std.values()), torch.zeros(0))
        out.add(("advantage_groups",), groups.numel())
        return out


def normalize_components(
    per_component: Dict[str, torch.Tensor],
    weights: Sequence[float],
    group_size: int,
    eps: float = 1e-6,
) -> ComponentNormalization:
    """``sum_k w_k (r_k - mean_g(r_k)) / (std_g(r_k) + eps)``: each component normalised within its group.

    GDPO (Liu et al. 2026, "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward
    RL Optimization", arXiv:2601.05242): normalising the weighted *sum* lets a high-variance component drown
    the others and maps different component combinations to the same advantage; normalising each component
    first keeps them apart. ``std_g`` is the sample std, as in :class:`GroupRelativeAdvantage`; a group in
    which a component is constant gets 0 from it (no ``1 / eps`` blow-up). GDPO then normalises the sum
    over the batch: :class:`BatchStdAdvantage` on this output does exactly that (the sum has group mean 0).

    Args:
        per_component (Dict[str, torch.Tensor]): unweighted scores of each component, each ``[N]``
            (``RolloutGroups.per_component``), in the order of ``weights``.
        weights (Sequence[float]): ``w_k``, one per component (``RewardSet.weights``).
        group_size (int): ``G``.
        eps (float): added to each group std. Default is 1e-6.

    Returns:
        ComponentNormalization: the combined signal and each component's share.

    Raises:
        ValueError: on a count of weights other than of components, or bad rewards (see
            :class:`AdvantageEstimator`).
    """
    if len(weights) != len(per_component):
        raise ValueError(f"{len(weights)} weights for {len(per_component)} reward components {list(per_component)}")
    parts: Dict[str, torch.Tensor] = {}
    zero: Dict[str, torch.Tensor] = {}
    total = None
    for (name, r), w in zip(per_component.items(), weights):
        zero[name] = zero_variance_groups(r, group_size)  # validates r
        g = r.detach().to(torch.float64).view(-1, int(group_size))  # [num_groups, G]
        z = (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True, correction=1) + eps)
        z = torch.where(zero[name].unsqueeze(1), torch.zeros_like(z), z).reshape(-1) * float(w)  # [N]
        parts[name] = z.to(torch.float32)
        total = z if total is None else total + z
    if total is None:
        raise ValueError("normalize_components needs at least one reward component")
    return ComponentNormalization(rewards=total.to(torch.float32), per_component=parts, zero_std=zero)


def advantage_signal(
    estimator: "AdvantageEstimator",
    rewards: torch.Tensor,
    per_component: Dict[str, torch.Tensor],
    weights: Sequence[float],
    group_size: int,
) -> Tuple[torch.Tensor, Optional[ComponentNormalization]]:
    """The rewards ``[N]`` the estimator takes: the weighted sum, or (GDPO) the normalised components' sum.

    Args:
        estimator (AdvantageEstimator): decides with its ``normalize_components`` flag.
        rewards (torch.Tensor): ``[N]`` the weighted reward sums.
        per_component (Dict[str, torch.Tensor]): each component's unweighted scores, ``[N]``.
        weights (Sequence[float]): the components' weights, in order.
        group_size (int): ``G``.

    Returns:
        Tuple[torch.Tensor, Optional[ComponentNormalization]]: the signal ``[N]`` and, with GDPO, the
        per-component shares (their metric sums); ``(rewards, None)`` otherwise.
    """
    if not getattr(estimator, "normalize_components", False):
        return rewards, None
    components = normalize_components(per_component, weights, group_size)
    return components.rewards, components


class AdvantageEstimator:
    """Base class: validation, zero-variance groups, optional clipping; subclasses give the formula.

    Every estimator computes in float64 and returns float32. A group whose rewards are all equal (see
    :func:`zero_variance_groups`) gets exactly 0 advantage, so float noise is never amplified (by ``1 /
    eps`` when dividing by a zero std).

    With ``normalize_components`` the recipe gives the estimator, instead of the weighted reward sum, the
    sum of the components each normalised within its group (:func:`normalize_components`, GDPO).

    Args:
        clip (Optional[float]): clamp advantages to ``[-clip, clip]`` after estimation (bounds the update
            from an outlier reward). Default is None (off).
        normalize_components (bool): normalise each reward component within its group before the weighted
            sum (GDPO). Default is False.
    """

    #: True when :meth:`__call__` wants ``batch_stats`` over the global batch.
    uses_batch_stats: bool = False

    def __init__(self, clip: Optional[float] = None, normalize_components: bool = False) -> None:
        if clip is not None and clip <= 0:
            raise ValueError(f"clip must be > 0 (or null), got {clip}")
        self.clip = None if clip is None else float(clip)
        self.normalize_components = bool(normalize_components)

    def _estimate(self, r: torch.Tensor, batch_stats: Optional[RewardStats]) -> torch.Tensor:
        """``r [num_groups, G]`` float64 -> advantages of the same shape."""
        raise NotImplementedError

    def _formula(self) -> str:
        raise NotImplementedError

    @property
    def formula(self) -> str:
        """The estimator as a one-line formula (for the algorithm card)."""
        text = self._formula()
        text = text if self.clip is None else f"clip({text}, -{self.clip:g}, {self.clip:g})"
        if self.normalize_components:
            text += (
                ";  here R_i = sum_k w_k * (R_k,i - mean(R_k, group)) / (std(R_k, group) + 1e-6), each reward "
                "component normalised within its group (0 where constant) before the weighted sum [GDPO]"
            )
        return text

    def __call__(
        self, rewards: torch.Tensor, group_size: int, *, batch_stats: Optional[RewardStats] = None
    ) -> AdvantageOutput:
        """Computes advantages.

        Args:
            rewards (torch.Tensor): total reward of each completion, shape ``[N]``; completions
                ``g*G .. (g+1)*G - 1`` form group ``g``.
            group_size (int): ``G``, completions per prompt.
            batch_stats (Optional[RewardStats]): statistics of the rewards of the *global* batch (summed
                over ranks); used only by estimators with ``uses_batch_stats``, which fall back to those of
                ``rewards`` when None (correct on one process). Default is None.

        Returns:
            AdvantageOutput: ``advantages [N]`` float32 and ``zero_std [N // G]`` bool, on
            ``rewards.device``.

        Raises:
            ValueError: if ``rewards`` is not 1-D or not finite, ``group_size < 1``, or ``N`` is not a
                multiple of ``group_size``.
        """
        zero_std = zero_variance_groups(rewards, group_size)
        n = rewards.numel()
        if n == 0:
            return AdvantageOutput(advantages=torch.zeros(0, device=rewards.device), zero_std=zero_std)
        r = rewards.detach().to(torch.float64).view(n // int(group_size), int(group_size))
        adv = self._estimate(r, batch_stats)
        adv = torch.where(zero_std.unsqueeze(1), torch.zeros_like(adv), adv)
        if self.clip is not None:
            adv = adv.clamp(-self.clip, self.clip)
        return AdvantageOutput(advantages=adv.reshape(n).to(torch.float32), zero_std=zero_std)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.formula})"


class GroupRelativeAdvantage(AdvantageEstimator):
    """``A_i = (r_i - mean_g) / (std_g + eps)`` within each group of ``G`` completions of one prompt.

    ``std_g`` is the *sample* (unbiased, Bessel-corrected, ``/(G - 1)``) standard deviation, as in
    DeepSeekMath's GRPO and TRL (``torch.std``). With ``scale_by_std=False`` the advantage is just
    ``r_i - mean_g``, as recommended by Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), which argues that
    dividing by the std over-weights prompts that are almost always or almost never solved.

    Args:
        scale_by_std (bool): divide by the group's standard deviation. Default is True.
        eps (float): added to the std to bound the scale of low-variance groups. Default is 1e-6.
        clip (Optional[float]): see :class:`AdvantageEstimator`. Default is None.
        normalize_components (bool): see :class:`AdvantageEstimator`. Default is False.
    """

    def __init__(
        self, scale_by_std: bool = True, eps: float = 1e-6, clip: Optional[float] = None,
        normalize_components: bool = False,
    ) -> None:
        super().__init__(clip=clip, normalize_components=normalize_components)
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.scale_by_std = scale_by_std
        self.eps = eps

    def _estimate(self, r: torch.Tensor, batch_stats: Optional[RewardStats]) -> torch.Tensor:
        adv = r - r.mean(dim=1, keepdim=True)
        if self.scale_by_std and r.size(1) > 1:
            # correction=1: the sample std, as DeepSeekMath/TRL. G == 1 would give NaN, but such groups are
            # all zero-variance and zeroed by the caller.
            adv = adv / (r.std(dim=1, keepdim=True, correction=1) + self.eps)
        return adv

    def _formula(self) -> str:
        if self.scale_by_std:
            return f"A_i = (R_i - mean(R_group)) / (std(R_group) + {self.eps:g})"
        return "A_i = R_i - mean(R_group)"


class RLOOAdvantage(AdvantageEstimator):
    """REINFORCE leave-one-out: ``A_i = r_i - mean_{j != i} r_j`` over the other ``G - 1`` completions.

    Each completion's baseline is independent of its own reward, so the policy gradient stays unbiased
    (Kool et al. 2019, "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024,
    arXiv:2402.14740). Equal to ``G / (G - 1) x (r_i - mean_g)``: GRPO's centring, rescaled, no std.

    Args:
        clip (Optional[float]): see :class:`AdvantageEstimator`. Default is None.
        normalize_components (bool): see :class:`AdvantageEstimator`. Default is False.
    """

    def _estimate(self, r: torch.Tensor, batch_stats: Optional[RewardStats]) -> torch.Tensor:
        g = r.size(1)
        if g < 2:
            return torch.zeros_like(r)  # no other sample to compare with (zeroed by the caller anyway)
        others_mean = (r.sum(dim=1, keepdim=True) - r) / (g - 1)
        return r - others_mean

    def _formula(self) -> str:
        return "A_i = R_i - mean_{j != i}(R_j in group)"


class BatchStdAdvantage(AdvantageEstimator):
    """``A_i = (r_i - mean_g) / (std_batch + eps)``: group mean as baseline, scale from the whole batch.

    The std is the sample standard deviation of all rewards of the *global* batch (every rank's), so
    prompts whose group happens to have a tiny spread are not blown up as with per-group std ("group mean,
    batch std", Liu et al. 2025, "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    arXiv:2508.08221; global normalisation as in REINFORCE++, Hu 2025, arXiv:2501.03262).

    The recipe passes ``batch_stats`` summed over ranks; without it the local rewards are used.

    Args:
        eps (float): added to the std. Default is 1e-6.
        clip (Optional[float]): see :class:`AdvantageEstimator`. Default is None.
        normalize_components (bool): see :class:`AdvantageEstimator`. Default is False.
    """

    uses_batch_stats = True

    def __init__(self, eps: float = 1e-6, clip: Optional[float] = None, normalize_components: bool = False) -> None:
        super().__init__(clip=clip, normalize_components=normalize_components)
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.eps = eps

    def _estimate(self, r: torch.Tensor, batch_stats: Optional[RewardStats]) -> torch.Tensor:
        stats = RewardStats.of(r) if batch_stats is None else RewardStats(*batch_stats)
        return (r - r.mean(dim=1, keepdim=True)) / (stats.std + self.eps)

    def _formula(self) -> str:
        return f"A_i = (R_i - mean(R_group)) / (std(R over the global batch) + {self.eps:g})"
