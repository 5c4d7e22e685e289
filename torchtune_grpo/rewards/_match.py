"""String rewards: exact match and contains, against a dataset column or fixed strings."""

from typing import Any, List, Optional, Sequence

from torchtune_grpo.rewards._base import Reward, RewardBatch, to_plain
from torchtune_grpo.rewards._math import EXTRACT_MODES, extract_answer

__all__ = ["ContainsReward", "ExactMatchReward"]


def _norm(text: str, ignore_case: bool, collapse_whitespace: bool) -> str:
    text = str(text)
    if collapse_whitespace:
        text = " ".join(text.split())
    return text.casefold() if ignore_case else text


def _targets(value: Any) -> List[str]:
    # A gold value may be one string or a list of acceptable strings (e.g. aliases).
    value = to_plain(value)
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value if v is not None]
    return [str(value)]


def _check_extract(extract: Optional[str]) -> None:
    if extract is not None and extract not in EXTRACT_MODES:
        raise ValueError(f"unknown extract mode {extract!r}; valid modes are None or {list(EXTRACT_MODES)}")


class ExactMatchReward(Reward):
    """1.0 when the completion (or the answer extracted from it) equals the gold answer, else 0.0.

    Both sides are stripped, and by default compared case-insensitively (``str.casefold``) with runs of
    whitespace collapsed to one space. The gold value ``fields[i][answer_key]`` may be a list of acceptable
    answers (any one matches). An empty extracted answer never matches.

    Args:
        answer_key (str): dataset field with the gold answer(s). Default is ``"answer"``.
        extract (Optional[str]): ``None`` (compare the whole completion) or an extraction mode of
            :func:`~torchtune_grpo.rewards.extract_answer` (``"answer_tag"``, ``"boxed"``,
            ``"last_number"``). Default is ``"answer_tag"``.
        ignore_case (bool): compare case-insensitively. Default is True.
        collapse_whitespace (bool): treat any run of whitespace as one space. Default is True.

    Raises:
        ValueError: if ``extract`` is unknown.
    """

    def __init__(
        self,
        answer_key: str = "answer",
        extract: Optional[str] = "answer_tag",
        ignore_case: bool = True,
        collapse_whitespace: bool = True,
    ) -> None:
        _check_extract(extract)
        self.answer_key = answer_key
        self.extract = extract
        self.ignore_case = ignore_case
        self.collapse_whitespace = collapse_whitespace

    def __call__(self, batch: RewardBatch) -> List[float]:
        scores = []
        for completion, fields in zip(batch.completions, batch.fields):
            if self.answer_key not in fields:
                raise KeyError(f"dataset fields have no gold answer {self.answer_key!r}: {sorted(fields)}")
            text = completion or ""
            pred = text if self.extract is None else extract_answer(text, self.extract)
            pred = _norm(pred, self.ignore_case, self.collapse_whitespace).strip() if pred is not None else ""
            golds = {_norm(g, self.ignore_case, self.collapse_whitespace).strip() for g in _targets(fields[self.answer_key])}
            scores.append(1.0 if pred and pred in golds else 0.0)
        return scores


class ContainsReward(Reward):
    """1.0 when the completion contains any of the target strings, else 0.0.

    Targets are either fixed strings (``values``, e.g. phrases to reward or, with a negative weight, to
    penalise) or the gold answer(s) of each sample (``fields[i][answer_key]``). Empty targets never match.

    Example YAML (penalise refusals)::

        - _component_: torchtune_grpo.rewards.ContainsReward
          values: ["I cannot help", "As an AI"]
          name: refusal
          weight: -0.5

    Args:
        values (Optional[Sequence[str]]): fixed target strings. Default is None (use ``answer_key``).
        answer_key (str): dataset field with the target(s) when ``values`` is None. Default is ``"answer"``.
        extract (Optional[str]): search only the extracted answer (see :class:`ExactMatchReward`) instead of
            the whole completion. Default is None.
        ignore_case (bool): compare case-insensitively. Default is True.
    """

    def __init__(
        self,
        values: Optional[Sequence[str]] = None,
        answer_key: str = "answer",
        extract: Optional[str] = None,
        ignore_case: bool = True,
    ) -> None:
        _check_extract(extract)
        values = to_plain(values)
        if values is not None and isinstance(values, str):
            values = [values]
        self.values = None if values is None else [str(v) for v in values]
        self.answer_key = answer_key
        self.extract = extract
        self.ignore_case = ignore_case

    def __call__(self, batch: RewardBatch) -> List[float]:
        scores = []
        for completion, fields in zip(batch.completions, batch.fields):
            if self.values is not None:
                targets = self.values
            elif self.answer_key in fields:
                targets = _targets(fields[self.answer_key])
            else:
                raise KeyError(f"dataset fields have no {self.answer_key!r}: {sorted(fields)}")
            text = completion or ""
            if self.extract is not None:
                text = extract_answer(text, self.extract) or ""
            text = _norm(text, self.ignore_case, False)
            hit = any(t and _norm(t, self.ignore_case, False) in text for t in targets)
            scores.append(1.0 if hit else 0.0)
        return scores
