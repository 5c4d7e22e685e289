"""The reward contract: what a reward receives (:class:`RewardBatch`) and returns, and its options.

A reward is any callable ``reward(batch: RewardBatch) -> List[float]`` returning one score per completion
(a :class:`Reward` subclass may implement ``score_one(sample) -> float`` instead).
:class:`~torchtune_grpo.rewards._reward_set.RewardSet` calls
each component, checks what it returned, replaces the scores of samples whose component raised or timed
out by a fallback (a reward must never crash a run), and sums the weighted components.

Per component (YAML keys next to ``_component_``, or attributes of the reward object):

- ``timeout``: seconds per sample. Setting it makes the component run per sample (see ``per_sample``).
  Without one, a call may run :data:`DEFAULT_REWARD_TIMEOUT` seconds (the whole batch in batch mode);
  ``None`` in YAML (``timeout: null``, :data:`NO_TIMEOUT` in code) means no limit.
- ``fallback``: the score of a failed sample. Default: the set's ``fallback``.
- ``per_sample``: call the component once per sample, each call isolated (its own exception handling and
  timeout). Default: True when a timeout is set, else False (one call for the whole batch).
- ``concurrency``: per-sample calls in flight at once (threads). Default: 1.
"""

import functools
import math
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from torchtune_grpo.rewards._execution import resolve_awaitable

__all__ = [
    "DEFAULT_REWARD_TIMEOUT",
    "NO_TIMEOUT",
    "OPTION_KEYS",
    "Reward",
    "RewardBatch",
    "RewardOutput",
    "RewardSample",
    "Steps",
    "reward_name",
    "to_plain",
]

#: Keys of a reward's YAML entry that configure :class:`RewardSet`, not the reward's constructor.
OPTION_KEYS = ("weight", "name", "timeout", "fallback", "per_sample", "concurrency")

#: Seconds one call of a reward that sets no ``timeout`` may run (the whole batch in batch mode, one sample
#: in per-sample mode) before its samples are scored with the fallback and counted: long enough for any
#: sane reward on a large batch, short enough that a reward that never returns cannot hang a run forever.
DEFAULT_REWARD_TIMEOUT = 300.0


def to_plain(value: Any) -> Any:
    """Converts OmegaConf containers (what YAML arguments arrive as) to plain dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value
#: A ``timeout`` that means "no limit" (``timeout: null`` in YAML): the call runs in the calling thread,
#: as rewards without a timeout did before the default existed; a watchdog only logs while it runs long.
NO_TIMEOUT = math.inf


class RewardSample(NamedTuple):
    """One completion, as :meth:`Reward.score_one` sees it.

    Attributes:
        prompt (str): the prompt text.
        completion (str): the decoded completion text.
        completion_ids (List[int]): the completion token ids.
        fields (Dict[str, Any]): the prompt's dataset columns except ``tokens`` (``fields["answer"]``...).
        token_offsets (Optional[List[int]]): the end of each completion token's characters in
            ``completion`` (step-level rewards map step boundaries to tokens with it). Default is None.
    """

    prompt: str
    completion: str
    completion_ids: List[int]
    fields: Dict[str, Any]
    token_offsets: Optional[List[int]] = None


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
        token_offsets (Optional[List[List[int]]]): per completion, the end of each token's characters in
            its text (:func:`~torchtune_grpo.rewards.token_offsets`); filled by ``sample_and_score`` when
            the reward set has a step-level component, else None. Default is None.
    """

    prompts: List[str]
    completions: List[str]
    completion_ids: List[List[int]]
    fields: List[Dict[str, Any]]
    token_offsets: Optional[List[List[int]]] = None

    @classmethod
    def for_groups(
        cls,
        prompts: List[str],
        fields: List[Dict[str, Any]],
        completions: List[str],
        completion_ids: List[List[int]],
        group_size: int,
        token_offsets: Optional[List[List[int]]] = None,
    ) -> "RewardBatch":
        """Builds the batch of a rollout from its per-prompt data (B prompts, ``B x group_size`` completions).

        Args:
            prompts (List[str]): B prompt texts.
            fields (List[Dict[str, Any]]): B prompts' dataset columns.
            completions (List[str]): N = B x group_size decoded completions, grouped by prompt.
            completion_ids (List[List[int]]): their token ids.
            group_size (int): completions per prompt.
            token_offsets (Optional[List[List[int]]]): see the class. Default is None.

        Returns:
            RewardBatch: with ``prompts`` and ``fields`` repeated for every completion of a group.
        """
        n = len(completions)
        return cls(
            prompts=[prompts[i // group_size] for i in range(n)],
            completions=completions,
            completion_ids=completion_ids,
            fields=[fields[i // group_size] for i in range(n)],
            token_offsets=token_offsets,
        )

    def sample(self, i: int) -> RewardSample:
        """Returns completion ``i`` as a :class:`RewardSample`."""
        offsets = None if self.token_offsets is None else self.token_offsets[i]
        return RewardSample(self.prompts[i], self.completions[i], self.completion_ids[i], self.fields[i], offsets)

    def select(self, indices: Sequence[int]) -> "RewardBatch":
        """Returns the sub-batch of the given completion indices, in that order."""
        return RewardBatch(
            prompts=[self.prompts[i] for i in indices],
            completions=[self.completions[i] for i in indices],
            completion_ids=[self.completion_ids[i] for i in indices],
            fields=[self.fields[i] for i in indices],
            token_offsets=None if self.token_offsets is None else [self.token_offsets[i] for i in indices],
        )

    def columns(self) -> Dict[str, List[Any]]:
        """The dataset columns as lists aligned with ``completions`` (a key missing from a sample's fields
        gives None there), e.g. ``{"answer": ["42", "42", ...], "prompt": [...]}``."""
        keys: Dict[str, None] = {}
        for f in self.fields:
            for k in f:
                keys.setdefault(k, None)
        return {k: [f.get(k) for f in self.fields] for k in keys}


class Steps(NamedTuple):
    """A step-level reward's result for one completion (:class:`~torchtune_grpo.rewards.StepReward`).

    Attributes:
        scores (List[float]): one score per step.
        ends (List[int]): the response-token index of each step's last token, strictly increasing, within
            the completion's tokens.
    """

    scores: List[float]
    ends: List[int]


class RewardOutput(NamedTuple):
    """What :class:`RewardSet` returns for a batch of ``N`` completions.

    Attributes:
        total (torch.Tensor): weighted sum of the components, shape ``[N]``, float32.
        per_component (Dict[str, torch.Tensor]): the unweighted scores of each component, each ``[N]``
            float32, keyed by component name (fallback values included where a component raised).
        errors (Dict[str, int]): for every component, the number of samples given the fallback (0 when the
            component ran cleanly). Every component name is present, so logged metrics keep the same keys.
        steps (Optional[List[Steps]]): the step-level component's steps of each completion (a failed
            completion: one step over all its tokens, scored with the fallback); None without one.
            Default is None.
        step_component (Optional[str]): that component's name. Default is None.
    """

    total: torch.Tensor
    per_component: Dict[str, torch.Tensor]
    errors: Dict[str, int]
    steps: Optional[List[Steps]] = None
    step_component: Optional[str] = None


def _snake_case(name: str) -> str:
    # "MathAnswerReward" -> "math_answer_reward", "HTTPReward" -> "http_reward".
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return name.lower()


class Reward:
    """Optional base class for rewards.

    Implement either ``__call__(batch: RewardBatch) -> List[float]`` (whole batch, the fast path for
    vectorised or batched rewards such as a model judge) or ``score_one(sample: RewardSample) -> float``
    (one completion; ``__call__`` then loops over the batch, a sample whose ``score_one`` raises failing
    alone, and :class:`RewardSet` calls ``score_one`` directly when the component runs per sample). Either
    may be ``async def``.

    A score may be replaced by an exception instance (``return [1.0, ValueError("no score"), 0.0]``) to
    mark that one sample as failed: it gets the fallback and counts in ``errors``. Raising fails every
    sample of the call.

    The class attribute ``name`` is the snake_case class name unless the subclass sets it
    (``MathAnswerReward`` -> ``"math_answer_reward"``); an instance may also set ``self.name``. Plain
    functions work as rewards too: their name is ``__name__``.

    Class (or instance) attributes that :class:`RewardSet` reads as defaults, each overridden by the
    same key in the reward's YAML entry:

    - ``timeout`` (Optional[float]): seconds per sample. Default is None (the set's default limit per call;
      :data:`NO_TIMEOUT` for none).
    - ``fallback`` (Optional[float]): score of a failed sample. Default is None (the set's fallback).
    - ``per_sample`` (Optional[bool]): run once per sample. Default is None (True iff a timeout is set).
    - ``concurrency`` (int): per-sample calls in flight. Default is 1.
    """

    name: str = "reward"
    timeout: Optional[float] = None
    fallback: Optional[float] = None
    per_sample: Optional[bool] = None
    concurrency: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Each subclass gets its own default, not its parent's, unless it sets `name` itself.
        if "name" not in cls.__dict__:
            cls.name = _snake_case(cls.__name__)

    def score_one(self, sample: RewardSample) -> float:
        """Scores one completion. Override this or ``__call__``."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement score_one(sample) -> float or __call__(batch) -> List[float]"
        )

    def __call__(self, batch: RewardBatch) -> List[Any]:
        if type(self).score_one is Reward.score_one:
            raise NotImplementedError(
                f"{type(self).__name__} must implement score_one(sample) -> float or __call__(batch) -> List[float]"
            )
        scores: List[Any] = []
        for i in range(len(batch.completions)):
            try:
                scores.append(resolve_awaitable(self.score_one(batch.sample(i))))
            except Exception as e:  # noqa: BLE001 - this sample fails alone (see the class docstring)
                scores.append(e)
        return scores


def _has_score_one(reward: Any) -> bool:
    if isinstance(reward, Reward):
        return type(reward).score_one is not Reward.score_one
    return callable(getattr(reward, "score_one", None))


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
