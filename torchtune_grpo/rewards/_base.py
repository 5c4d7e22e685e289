"""The reward contract and :class:`RewardSet`, which combines weighted reward components.

A reward is any callable ``reward(batch: RewardBatch) -> List[float]`` returning one score per completion.
:class:`RewardSet` calls each component on the whole batch, checks what it returned, replaces the scores of a
component that raised by a fallback (a reward must never crash a run), and sums the weighted components.
"""

import functools
import logging
import math
import numbers
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

__all__ = ["Reward", "RewardBatch", "RewardOutput", "RewardSet", "build_reward_set", "reward_name"]

log = logging.getLogger(__name__)


class RewardBatch(NamedTuple):
    """The completions of one rollout, as rewards see them. All lists have length ``N``.

    Completion ``i`` answers prompt ``i // group_size``; ``prompts[i]`` and ``fields[i]`` are repeated for
    every completion of a group, so a reward never needs to know the group size.

    Attributes:
        prompts (List[str]): the prompt text of each completion.
        completions (List[str]): the decoded completion text.
        completion_ids (List[List[int]]): the completion token ids (stop token included when one was sampled).
        fields (List[Dict[str, Any]]): the prompt's dataset columns except ``tokens``; ``fields[i]["answer"]``
            is the gold answer string.
    """

    prompts: List[str]
    completions: List[str]
    completion_ids: List[List[int]]
    fields: List[Dict[str, Any]]


class RewardOutput(NamedTuple):
    """What :class:`RewardSet` returns for a batch of ``N`` completions.

    Attributes:
        total (torch.Tensor): weighted sum of the components, shape ``[N]``, float32.
        per_component (Dict[str, torch.Tensor]): the unweighted scores of each component, each ``[N]``
            float32, keyed by component name (fallback values included where a component raised).
        errors (Dict[str, int]): for every component, the number of samples given the fallback (0 when the
            component ran cleanly). Every component name is present, so logged metrics keep the same keys.
    """

    total: torch.Tensor
    per_component: Dict[str, torch.Tensor]
    errors: Dict[str, int]


def _snake_case(name: str) -> str:
    # "MathAnswerReward" -> "math_answer_reward", "HTTPReward" -> "http_reward".
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return name.lower()


class Reward:
    """Optional base class for rewards.

    Subclasses implement ``__call__(batch: RewardBatch) -> List[float]``. The class attribute ``name`` is
    the snake_case class name unless the subclass sets it (``MathAnswerReward`` -> ``"math_answer_reward"``);
    an instance may also set ``self.name``. Plain functions work as rewards too: their name is
    ``__name__``.
    """

    name: str = "reward"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Each subclass gets its own default, not its parent's, unless it sets `name` itself.
        if "name" not in cls.__dict__:
            cls.name = _snake_case(cls.__name__)

    def __call__(self, batch: RewardBatch) -> List[float]:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(batch) -> List[float]")


def reward_name(reward: Callable[..., Any]) -> str:
    """The default name of a reward: its ``name`` attribute, else the function's ``__name__``, else the
    snake_case class name. ``functools.partial`` objects are named after the wrapped function.

    Args:
        reward (Callable[..., Any]): a reward callable.

    Returns:
        str: the name used for metrics and error messages.
    """
    name = getattr(reward, "name", None)
    if isinstance(name, str) and name:
        return name
    if isinstance(reward, functools.partial):
        return reward_name(reward.func)
    name = getattr(reward, "__name__", None)
    if isinstance(name, str) and name:
        return name
    return _snake_case(type(reward).__name__)


def _check_scores(name: str, scores: Any, n: int) -> List[float]:
    """Converts a component's output to floats, raising ValueError (naming the component) when it is not
    ``n`` finite real numbers. A wrong output is a bug in the reward, so it is not swallowed."""
    if not isinstance(scores, (list, tuple)) and hasattr(scores, "tolist"):
        # torch tensors and numpy arrays: accepted when 1-D.
        if getattr(scores, "ndim", 1) != 1:
            raise ValueError(
                f"reward {name!r} returned an array of shape {tuple(scores.shape)}; expected a 1-D list of {n}"
            )
        scores = scores.tolist()
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
        raise ValueError(f"reward {name!r} returned {type(scores).__name__}; expected a list of {n} floats")
    if len(scores) != n:
        raise ValueError(f"reward {name!r} returned {len(scores)} scores for a batch of {n} completions")
    out = []
    for i, s in enumerate(scores):
        # numbers.Real covers int, float, bool and numpy scalars; strings, None, complex are rejected.
        if not isinstance(s, numbers.Real):
            raise ValueError(f"reward {name!r} returned a non-number at index {i}: {s!r}")
        f = float(s)
        if not math.isfinite(f):
            raise ValueError(f"reward {name!r} returned a non-finite score at index {i}: {f}")
        out.append(f)
    return out


class RewardSet:
    """Weighted sum of reward components, robust to components that raise.

    Each component is called once on the whole batch. A component that raises is logged (warning with its
    name and the exception) and scored ``fallback`` on every sample of the batch; ``errors[name]`` counts
    those samples. A component that returns the wrong number of scores, a non-number or a NaN/inf raises
    ``ValueError``: that is a bug in the reward, not a property of the model's output.

    Args:
        rewards (List[Callable]): components, each ``reward(batch: RewardBatch) -> List[float]``.
        weights (List[float]): one finite weight per component.
        names (Optional[List[str]]): one unique name per component, used as metric keys. Default is None:
            each component's own name (see :func:`reward_name`).
        fallback (float): score given to every sample of a component that raised. Default is 0.0.

    Raises:
        ValueError: if the list is empty, lengths differ, a weight or the fallback is not finite, or names
            are not unique.

    Example:
        >>> rs = RewardSet([MathAnswerReward(), FormatReward()], weights=[1.0, 0.1])
        >>> out = rs(batch)
        >>> out.total  # [N] float32: 1.0 * correctness + 0.1 * format
    """

    def __init__(
        self,
        rewards: List[Callable[[RewardBatch], List[float]]],
        weights: List[float],
        names: Optional[List[str]] = None,
        fallback: float = 0.0,
    ) -> None:
        rewards = list(rewards)
        weights = [float(w) for w in weights]
        if not rewards:
            raise ValueError("RewardSet needs at least one reward component")
        if len(weights) != len(rewards):
            raise ValueError(f"RewardSet got {len(rewards)} rewards but {len(weights)} weights")
        for r in rewards:
            if not callable(r):
                raise ValueError(f"reward component {r!r} is not callable")
        names = [reward_name(r) for r in rewards] if names is None else [str(n) for n in names]
        if len(names) != len(rewards):
            raise ValueError(f"RewardSet got {len(rewards)} rewards but {len(names)} names")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"reward names must be unique, got duplicates {dupes}; set a distinct `name` for each component"
            )
        for n, w in zip(names, weights):
            if not math.isfinite(w):
                raise ValueError(f"weight of reward {n!r} must be finite, got {w}")
        fallback = float(fallback)
        if not math.isfinite(fallback):
            raise ValueError(f"fallback must be finite, got {fallback}")
        self.rewards = rewards
        self.weights = weights
        self.names = names
        self.fallback = fallback

    def __call__(self, batch: RewardBatch) -> RewardOutput:
        """Scores a batch.

        Args:
            batch (RewardBatch): ``N`` completions with their prompts and dataset fields.

        Returns:
            RewardOutput: ``total [N]``, ``per_component`` (each ``[N]``) and ``errors``.

        Raises:
            ValueError: if the batch's lists differ in length, or a component returns a malformed result.
        """
        n = len(batch.completions)
        lengths = {k: len(v) for k, v in batch._asdict().items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"RewardBatch lists must all have the same length, got {lengths}")

        # Accumulate in float64 so the weighted sum does not depend on component order at fp32 precision.
        total = torch.zeros(n, dtype=torch.float64)
        per_component: Dict[str, torch.Tensor] = {}
        errors: Dict[str, int] = {}
        for reward, weight, name in zip(self.rewards, self.weights, self.names):
            try:
                raw = reward(batch)
            except Exception as e:  # noqa: BLE001 - a reward must never crash a run (see DESIGN.md)
                log.warning(
                    "reward %r raised %s: %s; scoring all %d samples of this batch %s",
                    name,
                    type(e).__name__,
                    e,
                    n,
                    self.fallback,
                )
                scores = [self.fallback] * n
                errors[name] = n
            else:
                scores = _check_scores(name, raw, n)
                errors[name] = 0
            values = torch.tensor(scores, dtype=torch.float64)
            total += weight * values
            per_component[name] = values.to(torch.float32)
        return RewardOutput(total=total.to(torch.float32), per_component=per_component, errors=errors)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights))
        return f"RewardSet({parts}, fallback={self.fallback:g})"


def build_reward_set(specs: Sequence[Any], fallback: float = 0.0) -> RewardSet:
    """Builds a :class:`RewardSet` from the recipe's YAML list of reward specs.

    Each spec is a DictConfig or dict with a ``_component_`` dotpath, optional ``weight`` (default 1.0) and
    ``name`` (default the instantiated reward's own name), and any constructor keyword arguments::

        rewards:
          - _component_: torchtune_grpo.rewards.MathAnswerReward
            weight: 1.0
            name: correctness
            extract: answer_tag
          - _component_: torchtune_grpo.rewards.FormatReward
            weight: 0.1

    Args:
        specs (Sequence[Any]): the list of specs (a ListConfig or list of dicts/DictConfigs).
        fallback (float): passed to :class:`RewardSet`. Default is 0.0.

    Returns:
        RewardSet: the instantiated, weighted rewards.

    Raises:
        ValueError: if ``specs`` is empty or None, or a spec is not a mapping with a ``_component_``.
    """
    # Imported here so importing the rewards package stays light (torchtune.config pulls in the models).
    from torchtune import config as tt_config

    if specs is None or len(specs) == 0:
        raise ValueError(
            "no rewards configured: give a non-empty list of reward specs, e.g. "
            "[{_component_: torchtune_grpo.rewards.MathAnswerReward, weight: 1.0}]"
        )
    rewards, weights, names = [], [], []
    for i, spec in enumerate(specs):
        if isinstance(spec, DictConfig):
            # A resolved copy (interpolations into the rest of the config still work while `spec` is
            # attached), so popping weight/name never mutates the recipe's config.
            cfg = OmegaConf.create(OmegaConf.to_container(spec, resolve=True))
        elif isinstance(spec, dict):
            cfg = OmegaConf.create(dict(spec))
        else:
            raise ValueError(f"reward spec {i} must be a mapping with a `_component_`, got {type(spec).__name__}")
        if "_component_" not in cfg:
            raise ValueError(f"reward spec {i} has no `_component_`: {OmegaConf.to_container(cfg)}")
        weight = cfg.pop("weight", 1.0)
        name = cfg.pop("name", None)
        reward = tt_config.instantiate(cfg)
        rewards.append(reward)
        weights.append(float(weight))
        names.append(str(name) if name is not None else reward_name(reward))
    return RewardSet(rewards, weights, names=names, fallback=fallback)
