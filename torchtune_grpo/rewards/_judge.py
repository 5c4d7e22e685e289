"""What the model judges share: rubric templates and reading a score out of a judge's reply."""

import re
import string
from typing import Any, Dict, Optional

from torchtune_grpo.rewards._base import RewardSample

__all__ = [
    "DEFAULT_RUBRIC",
    "DEFAULT_YES_NO_RUBRIC",
    "check_rubric",
    "format_rubric",
    "parse_score",
    "rubric_fields",
]

#: Default rubric of :class:`~torchtune_grpo.rewards.HTTPJudge`: asks for a 0-10 score.
DEFAULT_RUBRIC = (
    "You are grading a response to a task.\n\n"
    "Task:\n{question}\n\n"
    "Reference answer (may be empty):\n{answer}\n\n"
    "Response:\n{completion}\n\n"
    "Rate how correct and helpful the response is, from 0 (worst) to 10 (best). "
    "Reply with the number only."
)

#: Default rubric of :class:`~torchtune_grpo.rewards.ModelJudge`: a yes/no question.
DEFAULT_YES_NO_RUBRIC = (
    "Task:\n{question}\n\n"
    "Reference answer:\n{answer}\n\n"
    "Response:\n{completion}\n\n"
    "Is the response correct? Answer Yes or No.\nAnswer:"
)

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def rubric_fields(sample: RewardSample, max_completion_chars: Optional[int] = None) -> Dict[str, Any]:
    """The values a rubric may use: ``{prompt}``, ``{completion}``, ``{question}`` (the dataset's
    ``question`` column, else the prompt), ``{answer}`` (else empty) and every other dataset column.

    Args:
        sample (RewardSample): the completion to judge.
        max_completion_chars (Optional[int]): longer completions are cut to this many characters (their
            end is replaced by ``"..."``). Default is None (no limit).

    Returns:
        Dict[str, Any]: the rubric's fields.
    """
    completion = sample.completion or ""
    if max_completion_chars is not None and len(completion) > max_completion_chars:
        completion = completion[:max_completion_chars] + "..."
    values: Dict[str, Any] = {k: v for k, v in sample.fields.items() if isinstance(k, str)}
    values.setdefault("question", sample.prompt)
    values.setdefault("answer", "")
    values["prompt"] = sample.prompt
    values["completion"] = completion
    return values


def check_rubric(rubric: str) -> None:
    """Raises ValueError if ``rubric`` is not a valid ``str.format`` template (unbalanced braces).

    Args:
        rubric (str): the template.

    Raises:
        ValueError: with the parse error and a reminder to double literal braces.
    """
    try:
        list(string.Formatter().parse(rubric))
    except ValueError as e:
        raise ValueError(f"invalid rubric template ({e}); write literal braces as '{{{{' and '}}}}'") from e


def format_rubric(rubric: str, values: Dict[str, Any]) -> str:
    """Fills a rubric template (``str.format`` syntax) with :func:`rubric_fields` values.

    Args:
        rubric (str): the template, e.g. ``"Question: {question}\\nAnswer: {completion}\\nScore:"``.
        values (Dict[str, Any]): the fields.

    Returns:
        str: the judge prompt.

    Raises:
        KeyError: if the rubric names a field the sample does not have (the message lists those it has).
    """
    try:
        return rubric.format_map(values)
    except KeyError as e:
        raise KeyError(f"rubric uses {{{e.args[0]}}} but the sample has only {sorted(values)}") from None


def parse_score(reply: str, max_score: float = 10.0, pattern: Optional[str] = None) -> float:
    """Reads a judge's score from its reply and scales it to ``[0, 1]``.

    The score is the first number in the reply (or the first group of ``pattern`` when given), divided by
    ``max_score``.

    Args:
        reply (str): the judge's text.
        max_score (float): the top of the rubric's scale. Default is 10.0.
        pattern (Optional[str]): a regular expression whose first group is the score. Default is None.

    Returns:
        float: the score in ``[0, 1]``.

    Raises:
        ValueError: if there is no number, or it is outside ``[0, max_score]``.
    """
    text = reply or ""
    if pattern is not None:
        m = re.search(pattern, text)
        token = m.group(1) if m else None
    else:
        m = _NUMBER.search(text[:10_000])
        token = m.group() if m else None
    if token is None:
        raise ValueError(f"no score in judge reply {text[:200]!r}")
    value = float(token)
    if not 0.0 <= value <= max_score:
        raise ValueError(f"judge score {value:g} outside [0, {max_score:g}] in reply {text[:200]!r}")
    return value / max_score
