"""A step checker for worked column additions (the tiny demos' task), for :class:`~torchtune_grpo.rewards.PythonStepReward`.

The demos' worked solutions write one column per step, units first, separated by ``,``
(:func:`~torchtune_grpo.data.addition_worked_solution`)::

    8+7=15,5+6+1=12 </think> <answer> 125 </answer>

A step is right when its sum is right and the carry it adds is the carry out of the column before (none in
the units column); the last step is right only if, besides, the answer it gives is the number its columns
make. A careless derivation that drops a carry and still writes the true sum (a lucky answer) fails at the
dropped carry, which an outcome reward on the answer cannot see.
"""

import re
from typing import List, Optional, Tuple

__all__ = ["column_addition_step"]

_COLUMN = re.compile(r"\s*(\d)\+(\d)(?:\+(\d))?=(\d+)")
_ANSWER = re.compile(r"<answer>\s*(\d+)\s*</answer>")


def _column(step: str) -> Optional[Tuple[int, int, Optional[int], int]]:
    m = _COLUMN.match(step)
    if m is None:
        return None
    a, b, c, total = m.groups()
    return int(a), int(b), None if c is None else int(c), int(total)


def column_addition_step(step: str, index: int, steps: List[str]) -> float:
    """1.0 when step ``index`` of a worked column addition is right, else 0.0 (see the module docstring).

    Args:
        step (str): the step text, e.g. ``"5+6+1=12"``.
        index (int): its position (0: the units column).
        steps (List[str]): every step of the completion.

    Returns:
        float: 1.0 or 0.0 (an unreadable step, or one after an unreadable step, is 0.0).
    """
    columns = [_column(s) for s in steps[: index + 1]]
    if any(c is None for c in columns):
        return 0.0
    a, b, carry, total = columns[index]
    expected_carry = None if index == 0 else columns[index - 1][3] // 10
    if carry != expected_carry or a + b + (carry or 0) != total:
        return 0.0
    if index == len(steps) - 1:  # the answer must be what the columns make
        answer = _ANSWER.search(step)
        digits = str(total) + "".join(str(c[3] % 10) for c in reversed(columns[:-1]))
        return float(answer is not None and answer.group(1) == digits)
    return 1.0
