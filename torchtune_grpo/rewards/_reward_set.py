""":class:`RewardSet`: calls each weighted reward component, checks its output, and sums the components.

A component that raises or times out on a sample gets the fallback score for that sample (a reward must
never crash a run); an output of the wrong shape or a non-finite score is a bug in the reward and raises
:class:`RewardOutputError` naming it. The options each component takes are described in
:mod:`torchtune_grpo.rewards._base`.
"""

import contextlib
import logging
import math
import numbers
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from torchtune_grpo.rewards._base import (
    _has_score_one,
    DEFAULT_REWARD_TIMEOUT,
    NO_TIMEOUT,
    RewardBatch,
    RewardOutput,
    reward_name,
    Steps,
)
from torchtune_grpo.rewards._execution import (
    call_with_timeout,
    Outcome,
    resolve_awaitable,
    RewardTimeoutError,
    run_each,
)
from torchtune_grpo.runtime.waits import WaitReport

__all__ = ["RewardOutputError", "RewardSet", "build_reward_set"]

log = logging.getLogger(__name__)


class RewardOutputError(ValueError):
    """A reward returned something other than one finite number (or exception) per completion."""


def _check_scores(name: str, scores: Any, n: int, lengths: Optional[Sequence[int]] = None) -> List[Any]:
    """Converts a component's output to a list of ``n`` floats or exception instances (failed samples),
    raising ValueError (naming the component) when it is anything else. A wrong output (wrong length,
    NaN, inf, a string, None) is a bug in the reward, so it is not swallowed. With ``lengths`` (the
    completions' token counts) the component is step-level and each entry must be :class:`Steps`."""
    if not isinstance(scores, (list, tuple)) and hasattr(scores, "tolist"):
        # torch tensors and numpy arrays: accepted when 1-D.
        if getattr(scores, "ndim", 1) != 1:
            raise RewardOutputError(
                f"reward {name!r} returned an array of shape {tuple(scores.shape)}; expected a 1-D list of {n}"
            )
        scores = scores.tolist()
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
        raise RewardOutputError(f"reward {name!r} returned {type(scores).__name__}; expected a list of {n} floats")
    if len(scores) != n:
        raise RewardOutputError(f"reward {name!r} returned {len(scores)} scores for a batch of {n} completions")
    return [_check_score(name, s, i, None if lengths is None else lengths[i]) for i, s in enumerate(scores)]


def _check_steps(name: str, s: Any, i: int, length: int) -> Steps:
    """A step-level result: ``scores`` and ``ends`` of equal length, finite scores, ends strictly
    increasing within ``0 .. length - 1``."""
    if not (hasattr(s, "scores") and hasattr(s, "ends")):
        raise RewardOutputError(f"step-level reward {name!r} returned {type(s).__name__} at index {i}; expected Steps")
    scores = [_check_score(name, x, i) for x in s.scores]
    if any(isinstance(x, BaseException) for x in scores):
        raise RewardOutputError(f"step-level reward {name!r} put an exception among the step scores at index {i}")
    ends = [int(e) for e in s.ends]
    if len(scores) != len(ends):
        raise RewardOutputError(f"step-level reward {name!r} returned {len(scores)} scores and {len(ends)} ends at index {i}")
    if any(b <= a for a, b in zip(ends, ends[1:])) or (ends and (ends[0] < 0 or ends[-1] > length - 1)):
        raise RewardOutputError(
            f"step-level reward {name!r} returned step ends {ends} at index {i}: need strictly increasing "
            f"token indices within 0..{length - 1}"
        )
    return Steps(scores, ends)


def _check_score(name: str, s: Any, i: int, length: Optional[int] = None) -> Any:
    if isinstance(s, BaseException):
        return s  # the reward marked this sample as failed
    if length is not None:
        return _check_steps(name, s, i, length)
    # numbers.Real covers int, float, bool and numpy scalars; strings, None, complex are rejected.
    if not isinstance(s, numbers.Real):
        if hasattr(s, "item") and getattr(s, "ndim", None) == 0:  # 0-d tensor or array
            s = s.item()
        if not isinstance(s, numbers.Real):
            raise RewardOutputError(f"reward {name!r} returned a non-number at index {i}: {s!r}")
    f = float(s)
    if not math.isfinite(f):
        raise RewardOutputError(f"reward {name!r} returned a non-finite score at index {i}: {f}")
    return f


def _describe(e: BaseException) -> str:
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _opt(value: Any, reward: Any, attr: str, default: Any) -> Any:
    if value is not None:
        return value
    value = getattr(reward, attr, None)
    return default if value is None else value


def _watchdog(name: str, n: int, limit: Optional[float]) -> ContextManager[Any]:
    """While the block runs, logs every :data:`~torchtune_grpo.runtime.waits.REPORT_EVERY` seconds that the reward
    is still running, so a slow or hung reward is named in the log instead of holding the run silently. A limit
    shorter than the interval ends the call before a report is due: then nothing is watched (a timeout is
    logged anyway)."""
    limit = None if limit is None or math.isinf(limit) else float(limit)
    key = "`timeout: null` in its entry" if limit is None else "`timeout` in its entry"
    report = WaitReport(f"reward {name!r} on a batch of {n} completions", limit=limit, limit_key=key,
                        say=log.warning)
    return report.watch() if limit is None or limit > report.every else contextlib.nullcontext()


class RewardSet:
    """Weighted sum of reward components, robust to components that raise or hang.

    Each component runs either once on the whole batch, or once per sample (``per_sample``), each sample
    with its own time limit (``timeout``) and exception handling, up to ``concurrency`` at a time. A failed
    sample (the component raised, timed out, or put an exception in place of the score) is logged (one
    warning per component and batch, naming it) and scored with the component's fallback; ``errors[name]``
    counts those samples. A batch-level call that raises or times out fails every sample of the batch.

    A component that returns the wrong number of scores, a non-number or a NaN/inf raises ``ValueError``
    naming the component: that is a bug in the reward, not a property of the model's output.

    Args:
        rewards (List[Callable]): components, each ``reward(batch: RewardBatch) -> List[float]``.
        weights (List[float]): one finite weight per component.
        names (Optional[List[str]]): one unique name per component, used as metric keys. Default is None:
            each component's own name (see :func:`reward_name`).
        fallback (float): default score of a failed sample. Default is 0.0.
        timeouts (Optional[List[Optional[float]]]): per component, seconds per sample (per call when
            ``per_sample`` is False); :data:`NO_TIMEOUT` for no limit. Default is None: each reward's
            ``timeout`` attribute, else ``default_timeout``.
        fallbacks (Optional[List[Optional[float]]]): per component fallback. Default is None: each reward's
            ``fallback`` attribute, else ``fallback``.
        per_sample (Optional[List[Optional[bool]]]): per component. Default is None: the reward's
            ``per_sample`` attribute, else True exactly when a timeout is set.
        concurrency (Optional[List[Optional[int]]]): per component, per-sample calls in flight. Default is
            None: the reward's ``concurrency`` attribute, else 1.
        default_timeout (Optional[float]): seconds one call of a component without a timeout of its own may
            run: the whole batch in batch mode (which it stays in), one sample in per-sample mode. The
            call then runs in a worker thread (with the caller's grad mode and CUDA device) and, past the
            limit, is given up: its samples get the fallback and count in ``errors``. None (or
            :data:`NO_TIMEOUT`) for no limit. Default is :data:`DEFAULT_REWARD_TIMEOUT` (300 s).

    Attributes:
        timeouts (List[Optional[float]]): each component's own timeout (None when it sets none).
        limits (List[Optional[float]]): the limit each call really runs under (None: no limit).

    Raises:
        ValueError: if the list is empty, lengths differ, a weight or fallback is not finite, a timeout is
            not positive, or names are not unique.

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
        timeouts: Optional[List[Optional[float]]] = None,
        fallbacks: Optional[List[Optional[float]]] = None,
        per_sample: Optional[List[Optional[bool]]] = None,
        concurrency: Optional[List[Optional[int]]] = None,
        default_timeout: Optional[float] = DEFAULT_REWARD_TIMEOUT,
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
        if default_timeout is not None:
            default_timeout = float(default_timeout)
            if not default_timeout > 0:  # NaN fails too; inf means no limit
                raise ValueError(f"default_timeout must be a positive number of seconds or None, got {default_timeout}")

        def per_component(values: Optional[Sequence[Any]], what: str) -> List[Any]:
            if values is None:
                return [None] * len(rewards)
            values = list(values)
            if len(values) != len(rewards):
                raise ValueError(f"RewardSet got {len(rewards)} rewards but {len(values)} {what}")
            return values

        self.timeouts: List[Optional[float]] = []
        self.limits: List[Optional[float]] = []
        self._default_limited: List[bool] = []
        self.fallbacks: List[float] = []
        self.per_sample: List[bool] = []
        self.concurrency: List[int] = []
        for r, n, t, fb, ps, c in zip(
            rewards,
            names,
            per_component(timeouts, "timeouts"),
            per_component(fallbacks, "fallbacks"),
            per_component(per_sample, "per_sample flags"),
            per_component(concurrency, "concurrency values"),
        ):
            t = _opt(t, r, "timeout", None)
            if t is not None:
                t = float(t)
                if not t > 0:  # NaN fails too; NO_TIMEOUT (inf) is "no limit"
                    raise ValueError(f"timeout of reward {n!r} must be a positive number of seconds, got {t}")
            # A component without a timeout of its own runs under the default limit, in its own mode.
            limit = default_timeout if t is None else t
            limit = None if limit is None or math.isinf(limit) else limit
            t = None if t is None or math.isinf(t) else t
            fb = float(_opt(fb, r, "fallback", fallback))
            if not math.isfinite(fb):
                raise ValueError(f"fallback of reward {n!r} must be finite, got {fb}")
            c = int(_opt(c, r, "concurrency", 1))
            if c < 1:
                raise ValueError(f"concurrency of reward {n!r} must be >= 1, got {c}")
            self.timeouts.append(t)
            self.limits.append(limit)
            self._default_limited.append(t is None and limit is not None)
            self.fallbacks.append(fb)
            self.per_sample.append(bool(_opt(ps, r, "per_sample", t is not None)))
            self.concurrency.append(c)
        self.rewards = rewards
        self.weights = weights
        self.names = names
        self.fallback = fallback
        steps = [n for r, n in zip(rewards, names) if getattr(r, "step_level", False)]
        if len(steps) > 1:
            raise ValueError(f"at most one step-level reward per set (its steps give the process advantage), got {steps}")
        #: The name of the step-level component (its per-step scores are kept), or None.
        self.step_component: Optional[str] = steps[0] if steps else None

    def _timeout_error(self, k: int, error: BaseException) -> BaseException:
        """Says, in a timeout that came from the default limit, where that limit comes from."""
        if not (self._default_limited[k] and isinstance(error, RewardTimeoutError)):
            return error
        return RewardTimeoutError(
            f"{error}: the default limit for a reward without a `timeout` (DEFAULT_REWARD_TIMEOUT); set "
            "`timeout` in this reward's entry to change it, or `timeout: null` for none"
        )

    def _run_component(self, k: int, batch: RewardBatch, n: int) -> List[Any]:
        """Scores of component ``k``: floats, or exceptions for failed samples."""
        reward, name, timeout = self.rewards[k], self.names[k], self.limits[k]
        lengths = [len(ids) for ids in batch.completion_ids] if name == self.step_component else None
        if not self.per_sample[k]:
            with _watchdog(name, n, timeout):
                out = call_with_timeout(lambda: reward(batch), timeout)
            if out.status != "ok":
                return [self._timeout_error(k, out.value)] * n
            return _check_scores(name, out.value, n, lengths)

        if _has_score_one(reward):
            def one(i: int) -> Any:
                return reward.score_one(batch.sample(i))
        else:
            def one(i: int) -> Any:
                one_length = None if lengths is None else [lengths[i]]
                return _check_scores(name, resolve_awaitable(reward(batch.select([i]))), 1, one_length)[0]

        with _watchdog(name, n, timeout):
            outcomes: List[Outcome] = run_each(one, n, timeout=timeout, concurrency=self.concurrency[k])
        scores = []
        for i, o in enumerate(outcomes):
            if o.status == "ok":
                scores.append(_check_score(name, o.value, i, None if lengths is None else lengths[i]))
            elif isinstance(o.value, RewardOutputError):
                raise o.value  # a malformed result is a bug in the reward, even per sample
            else:
                scores.append(self._timeout_error(k, o.value))
        return scores

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
        lengths = {k: len(v) for k, v in batch._asdict().items() if v is not None}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"RewardBatch lists must all have the same length, got {lengths}")

        # Accumulate in float64 so the weighted sum does not depend on component order at fp32 precision.
        total = torch.zeros(n, dtype=torch.float64)
        per_component: Dict[str, torch.Tensor] = {}
        errors: Dict[str, int] = {}
        steps: Optional[List[Steps]] = None
        for k, (weight, name) in enumerate(zip(self.weights, self.names)):
            raw = self._run_component(k, batch, n) if n else []
            failed = [s for s in raw if isinstance(s, BaseException)]
            fallback = self.fallbacks[k]
            if failed:
                kinds: Dict[str, int] = {}
                for e in failed:
                    kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
                log.warning(
                    "reward %r failed on %d of %d samples (%s; first: %s); scoring them %s",
                    name,
                    len(failed),
                    n,
                    ", ".join(f"{c} {t}" for t, c in sorted(kinds.items())),
                    _describe(failed[0]),
                    fallback,
                )
            if name == self.step_component:
                # A failed completion: one step over all its tokens, scored with the fallback.
                steps = [
                    Steps([fallback], [len(ids) - 1]) if isinstance(s, BaseException) and ids else
                    Steps([], []) if isinstance(s, BaseException) else s
                    for s, ids in zip(raw, batch.completion_ids)
                ]
                reduce = getattr(self.rewards[k], "aggregate_steps", None) or (lambda x: float(min(x)) if x else 0.0)
                raw = [s if isinstance(s, BaseException) else reduce(s.scores) for s in raw]
            scores = [fallback if isinstance(s, BaseException) else s for s in raw]
            errors[name] = len(failed)
            values = torch.tensor(scores, dtype=torch.float64)
            total += weight * values
            per_component[name] = values.to(torch.float32)
        return RewardOutput(
            total=total.to(torch.float32), per_component=per_component, errors=errors,
            steps=steps if self.step_component is not None else None, step_component=self.step_component,
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={w:g}" for n, w in zip(self.names, self.weights))
        return f"RewardSet({parts}, fallback={self.fallback:g})"


def build_reward_set(
    specs: Sequence[Any], fallback: float = 0.0, default_timeout: Optional[float] = DEFAULT_REWARD_TIMEOUT
) -> RewardSet:
    """Builds a :class:`RewardSet` from the recipe's YAML list of reward specs.

    Each spec is a DictConfig or dict with a ``_component_`` dotpath, any constructor keyword arguments,
    and these optional keys, which configure the set rather than the reward (see :data:`~torchtune_grpo.rewards._base.OPTION_KEYS`):
    ``weight`` (default 1.0), ``name`` (default the reward's own name), ``timeout`` (seconds per sample;
    absent: ``default_timeout`` per call; ``null``: no limit), ``fallback`` (score of a failed sample),
    ``per_sample`` and ``concurrency`` (see :class:`RewardSet`)::

        rewards:
          - _component_: torchtune_grpo.rewards.MathAnswerReward
            weight: 1.0
            name: correctness
            extract: answer_tag
            timeout: 5        # per sample; a slower sample scores the fallback
            fallback: 0.0
          - _component_: torchtune_grpo.rewards.FormatReward
            weight: 0.1

    Args:
        specs (Sequence[Any]): the list of specs (a ListConfig or list of dicts/DictConfigs).
        fallback (float): the default fallback (see :class:`RewardSet`). Default is 0.0.
        default_timeout (Optional[float]): the limit per call of a component whose entry sets no
            ``timeout`` (see :class:`RewardSet`). Default is :data:`DEFAULT_REWARD_TIMEOUT`.

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
    options: Dict[str, List[Any]] = {"timeout": [], "fallback": [], "per_sample": [], "concurrency": []}
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
        # `timeout: null` asks for no limit; an absent key for the default one.
        no_limit = "timeout" in cfg and cfg["timeout"] is None
        for key in options:
            options[key].append(cfg.pop(key, None))
        if no_limit:
            options["timeout"][-1] = NO_TIMEOUT
        reward = tt_config.instantiate(cfg)
        rewards.append(reward)
        weights.append(float(weight))
        names.append(str(name) if name is not None else reward_name(reward))
    return RewardSet(
        rewards,
        weights,
        names=names,
        fallback=fallback,
        timeouts=options["timeout"],
        fallbacks=options["fallback"],
        per_sample=options["per_sample"],
        concurrency=options["concurrency"],
        default_timeout=default_timeout,
    )
