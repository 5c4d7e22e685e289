"""Step-level (process) rewards: one score per reasoning step, with the steps' boundaries as token positions.

A completion is split into steps by a separator string (``"\\n\\n"`` by default, the convention of
Qwen2.5-Math-PRM, arXiv:2501.07301) or by a function; each step ends at a response token. A step-level
reward returns, per completion, :class:`Steps` (``scores``, one per step, and ``ends``, the index of each
step's last response token). :class:`~torchtune_grpo.rewards.RewardSet` keeps them for the
process-supervised advantage (:class:`~torchtune_grpo.rollouts.process_advantages.ProcessSupervisedAdvantage`,
DeepSeekMath, arXiv:2402.03300, section 4.1.3) and reduces them to one number per completion
(``aggregate``: ``min``, the usual PRM verdict of a whole solution, ``mean``, ``last`` or ``prod``) for the
outcome total and the metrics.

Character positions become token positions through ``RewardBatch.token_offsets`` (the end of each token
in the decoded completion), which :func:`~torchtune_grpo.rollouts.groups.sample_and_score` fills when the
reward set has a step-level component.
"""

import bisect
import math
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

from torchtune_grpo.rewards._base import Reward, RewardBatch, RewardSample, Steps, to_plain
from torchtune_grpo.rewards._execution import resolve_awaitable
from torchtune_grpo.rewards._python import _accepted_kwargs, load_function

__all__ = [
    "AGGREGATES",
    "PythonStepReward",
    "StepReward",
    "StepSpan",
    "StepSplitter",
    "Steps",
    "aggregate_steps",
    "token_offsets",
]

#: How a step-level reward's scores become one number per completion.
AGGREGATES = ("min", "mean", "last", "prod")


class StepSpan(NamedTuple):
    """One step of a completion: its text (separator removed, whitespace stripped) and last token."""

    text: str
    end: int


def aggregate_steps(scores: Sequence[float], how: str) -> float:
    """One number from step scores: ``min``, ``mean``, ``last`` or ``prod`` (0.0 without steps)."""
    if how not in AGGREGATES:
        raise ValueError(f"unknown aggregate {how!r}; valid: {list(AGGREGATES)}")
    if not scores:
        return 0.0
    if how == "min":
        return float(min(scores))
    if how == "mean":
        return float(sum(scores) / len(scores))
    if how == "last":
        return float(scores[-1])
    return float(math.prod(scores))


def token_offsets(decode: Callable[[List[int]], str], ids: Sequence[int], text: str) -> List[int]:
    """The end (exclusive) of each token's characters in ``text``, ``[len(ids)]``, non-decreasing.

    Tokens are decoded one by one; when the pieces do not add up to ``text`` (byte-level tokens that
    split a character, a tokenizer that merges spaces), every prefix is decoded instead. Tokens that
    decode to nothing (special tokens) end where the previous one did.

    Args:
        decode (Callable[[List[int]], str]): the policy tokenizer's decode (special tokens skipped), as
            the completion text was made.
        ids (Sequence[int]): the completion's token ids.
        text (str): the decoded completion.

    Returns:
        List[int]: character end offsets.
    """

    def safe(chunk: List[int]) -> str:
        try:
            return decode(chunk)
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
            return ""

    pieces = [safe([t]) for t in ids]
    if "".join(pieces) == text:
        out, pos = [], 0
        for p in pieces:
            pos += len(p)
            out.append(pos)
        return out
    out, best = [], 0
    for j in range(len(ids)):
        best = max(best, min(len(safe(list(ids[: j + 1]))), len(text)))
        out.append(best)
    return out


class StepSplitter:
    """Splits a completion into steps at a separator string, or with a function.

    With ``separator``, a step is the text up to and including the separator; whitespace-only steps
    join the step before them, and steps that would end in the same token are merged. The last step
    always ends at the completion's last token (a trailing stop token belongs to it), so every response
    token belongs to exactly one step.

    With ``function`` (a callable or where to find one, see :func:`~torchtune_grpo.rewards.load_function`),
    ``function(completion: str, completion_ids: List[int], token_offsets: List[int]) -> List[int]``
    returns the last token index of each step, taken as they are; the step texts are cut from the
    completion at those tokens, and a last step up to the last token is added when they stop short.

    Args:
        separator (str): the step separator. Default is ``"\\n\\n"``.
        function (Any): a splitting function instead of the separator. Default is None.

    Raises:
        ValueError: on an empty separator, or a function that cannot be found.
    """

    def __init__(self, separator: str = "\n\n", function: Any = None) -> None:
        if function is None and (not isinstance(separator, str) or not separator):
            raise ValueError(f"steps.separator must be a non-empty string, got {separator!r}")
        if isinstance(function, str):
            function = load_function(function)
        if function is not None and not callable(function):
            raise ValueError(f"steps.function must be callable, got {type(function).__name__}")
        self.separator = separator
        self.function = function

    @classmethod
    def build(cls, spec: Any) -> "StepSplitter":
        """A splitter from YAML: None (the default), a separator string, a mapping of the arguments, or a
        splitter object."""
        if spec is None:
            return cls()
        if isinstance(spec, StepSplitter):
            return spec
        if isinstance(spec, str):
            return cls(separator=spec)
        spec = to_plain(spec)
        if isinstance(spec, Mapping):
            unknown = set(spec) - {"separator", "function"}
            if unknown:
                raise ValueError(f"steps has unknown keys {sorted(unknown)}; valid: separator, function")
            return cls(**spec)
        raise ValueError(f"steps must be a separator string or a mapping {{separator|function}}, got {spec!r}")

    def _char_cuts(self, text: str) -> List[int]:
        cuts, start = [], 0
        while True:
            k = text.find(self.separator, start)
            if k < 0:
                return cuts
            start = k + len(self.separator)
            cuts.append(start)

    def __call__(self, completion: str, completion_ids: Sequence[int], offsets: Optional[Sequence[int]]) -> List[StepSpan]:
        """The steps of one completion (none when it has no tokens).

        Raises:
            ValueError: when ``offsets`` are missing or do not match the ids, or a split function returns
                ends that are not increasing token indices.
        """
        n = len(completion_ids)
        if n == 0:
            return []
        if offsets is None or len(offsets) != n:
            raise ValueError(
                "step-level rewards need the token offsets of each completion (RewardBatch.token_offsets, which "
                f"sample_and_score fills); got {None if offsets is None else len(offsets)} for {n} tokens"
            )
        if self.function is not None:  # its boundaries are taken as they are
            ends = [int(e) for e in self.function(completion, list(completion_ids), list(offsets))]
            if any(b <= a for a, b in zip(ends, ends[1:])) or (ends and (ends[0] < 0 or ends[-1] > n - 1)):
                raise ValueError(f"the step split function returned {ends}: need increasing indices in 0..{n - 1}")
            if not ends or ends[-1] != n - 1:
                ends.append(n - 1)  # the last step takes the trailing tokens
            starts = [0] + [offsets[e] for e in ends[:-1]]
            return [StepSpan(completion[a : offsets[e]].strip(), e) for a, e in zip(starts, ends)]
        cuts = self._char_cuts(completion)
        ends = [bisect.bisect_right(list(offsets), c - 1) for c in cuts]  # the token holding char c - 1
        spans: List[StepSpan] = []
        begin = 0
        for c, e in zip(cuts + [len(completion)], ends + [n - 1]):
            piece = completion[begin:c]
            begin = c
            if piece.endswith(self.separator):
                piece = piece[: -len(self.separator)]
            text, e = piece.strip(), min(e, n - 1)
            if spans and (not text or e <= spans[-1].end):
                # Whitespace only, or ending in the same token as the step before: part of that step.
                prev = spans[-1]
                spans[-1] = StepSpan(prev.text + self.separator + text if text else prev.text, max(e, prev.end))
            elif text:
                spans.append(StepSpan(text, e))
            # else: leading whitespace, whose tokens belong to the first step (it ends later)
        if not spans:
            spans = [StepSpan("", n - 1)]
        spans[-1] = StepSpan(spans[-1].text, n - 1)
        return spans

    def __repr__(self) -> str:
        how = f"function={getattr(self.function, '__name__', self.function)!r}" if self.function else f"separator={self.separator!r}"
        return f"StepSplitter({how})"


class StepReward(Reward):
    """Base class of step-level rewards: split each completion into steps, score every step.

    Implement ``score_steps(sample, steps) -> List[float]`` (one completion: one score per step text) or
    ``score_step_batch(batch, steps) -> List[List[float]]`` (the whole batch; an exception instance in
    place of a row fails that completion alone). A failed completion gets one step spanning all of it,
    scored with the fallback.

    Args:
        steps (Any): how completions split into steps: a separator string, ``{separator: ...}`` or
            ``{function: module.fn}`` (see :class:`StepSplitter`). Default is None (``"\\n\\n"``).
        aggregate (str): one of :data:`AGGREGATES`, the number per completion that enters the reward
            total and the metrics. Default is ``"min"``.
    """

    #: RewardSet keeps this component's per-step scores (``Steps``) for the process advantage.
    step_level: bool = True

    def __init__(self, steps: Any = None, aggregate: str = "min") -> None:
        if aggregate not in AGGREGATES:
            raise ValueError(f"unknown aggregate {aggregate!r}; valid: {list(AGGREGATES)}")
        self.splitter = StepSplitter.build(steps)
        self.aggregate = aggregate

    def aggregate_steps(self, scores: Sequence[float]) -> float:
        """The completion's number from its step scores (see ``aggregate``)."""
        return aggregate_steps(scores, self.aggregate)

    def split(self, sample: RewardSample) -> List[StepSpan]:
        """The steps of one completion."""
        return self.splitter(sample.completion, sample.completion_ids, sample.token_offsets)

    def score_steps(self, sample: RewardSample, steps: List[str]) -> List[float]:
        """Scores the steps of one completion. Override this or :meth:`score_step_batch`."""
        raise NotImplementedError(f"{type(self).__name__} must implement score_steps or score_step_batch")

    def score_step_batch(self, batch: RewardBatch, steps: List[List[str]]) -> List[Any]:
        """Scores the steps of every completion (default: :meth:`score_steps` one by one)."""
        out: List[Any] = []
        for i, texts in enumerate(steps):
            try:
                out.append(resolve_awaitable(self.score_steps(batch.sample(i), texts)))
            except Exception as e:  # noqa: BLE001 - this completion fails alone
                out.append(e)
        return out

    def score_one(self, sample: RewardSample) -> Steps:
        spans = self.split(sample)
        return self._steps(spans, resolve_awaitable(self.score_steps(sample, [s.text for s in spans])))

    @staticmethod
    def _steps(spans: List[StepSpan], scores: Any) -> Any:
        if isinstance(scores, BaseException):
            return scores
        scores = list(scores)
        if len(scores) != len(spans):
            return ValueError(f"{len(scores)} step scores for {len(spans)} steps")
        return Steps([float(s) for s in scores], [s.end for s in spans])

    def __call__(self, batch: RewardBatch) -> List[Any]:
        spans: List[Any] = []
        for i in range(len(batch.completions)):
            try:
                spans.append(self.split(batch.sample(i)))
            except ValueError as e:
                spans.append(e)
        ok = [i for i, s in enumerate(spans) if not isinstance(s, BaseException)]
        scored = resolve_awaitable(self.score_step_batch(batch.select(ok), [[s.text for s in spans[i]] for i in ok]))
        if len(scored) != len(ok):
            raise ValueError(f"{type(self).__name__}.score_step_batch returned {len(scored)} rows for {len(ok)}")
        out: List[Any] = list(spans)
        for i, scores in zip(ok, scored):
            out[i] = self._steps(spans[i], scores)
        return out


class PythonStepReward(StepReward):
    """A user function scores each step: ``fn(step: str, **context) -> float``.

    ``context`` holds ``index`` (the step's position), ``steps`` (every step text of the completion),
    ``previous`` (the steps before it), ``prompt``, ``completion``, every dataset column of the prompt
    (``answer``...) and ``function_kwargs``; the function receives only the names it declares (all of
    them with ``**kwargs``). An exception fails the whole completion (fallback).

    Example YAML::

        - _component_: torchtune_grpo.rewards.PythonStepReward
          function: my_checks.step_is_valid     # or /path/checks.py:step_is_valid
          steps: {separator: ","}
          aggregate: min
          weight: 0.0      # the process advantage reads the steps; 0 keeps the outcome total as it was

    Args:
        function (Any): the function or where to find it (see :func:`~torchtune_grpo.rewards.load_function`).
        function_kwargs (Optional[Mapping[str, Any]]): fixed keyword arguments. Default is None.
        steps (Any): see :class:`StepReward`. Default is None.
        aggregate (str): see :class:`StepReward`. Default is ``"min"``.
        name (Optional[str]): the reward's name. Default is None (the function's name).
    """

    def __init__(
        self, function: Any, function_kwargs: Optional[Mapping[str, Any]] = None, steps: Any = None,
        aggregate: str = "min", name: Optional[str] = None,
    ) -> None:
        super().__init__(steps=steps, aggregate=aggregate)
        if isinstance(function, str):
            function = load_function(function)
        if not callable(function):
            raise ValueError(f"function must be callable, got {type(function).__name__}")
        self.function = function
        self.function_kwargs = dict(to_plain(function_kwargs) or {})
        self._names = _accepted_kwargs(function)
        self.name = name or getattr(function, "__name__", None) or type(function).__name__

    def score_steps(self, sample: RewardSample, steps: List[str]) -> List[float]:
        out = []
        for j, step in enumerate(steps):
            context: Dict[str, Any] = {**self.function_kwargs, **sample.fields, "index": j, "steps": list(steps),
                                       "previous": list(steps[:j]), "prompt": sample.prompt,
                                       "completion": sample.completion}
            if self._names is not None:
                context = {k: v for k, v in context.items() if k in self._names}
            out.append(resolve_awaitable(self.function(step, **context)))
        return out

    def __repr__(self) -> str:
        return f"PythonStepReward({self.name}, {self.splitter!r})"
