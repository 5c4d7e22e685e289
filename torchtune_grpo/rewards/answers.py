"""Final answers in completions and gold labels: one extraction that datasets and rewards share.

A math dataset extracts its gold answer with the same :func:`extract_answer` the rewards use on
completions, so a label and a completion that say the same thing compare equal.
"""

import re
from typing import List, Optional

__all__ = ["EXTRACT_MODES", "extract_answer"]

#: Valid ``extract`` modes of :func:`extract_answer` (and of the rewards that extract answers).
EXTRACT_MODES = ("answer_tag", "boxed", "last_number")

_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
# `\boxed{`, `\fbox{` openings and plain braces, so one left-to-right pass can match braces with a stack.
_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# The last number of a text: integers (optionally with 3-digit comma groups), decimals and simple
# fractions. `\d` is Unicode-aware here on purpose (see the module docstring). The look-behind stops a
# match from starting inside a word or after a digit, so "5-3" ends with "3", not "-3", and "x2" has none.
_LAST_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str, mode: str = "answer_tag") -> Optional[str]:
    """Extracts the final answer from a completion.

    Args:
        text (str): the completion.
        mode (str): one of :data:`EXTRACT_MODES`. Default is ``"answer_tag"``.

            - ``"answer_tag"``: the content of the last ``<answer>...</answer>`` block; None when that
              content holds another ``</answer>`` (nested tags).
            - ``"boxed"``: the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), with
              nested braces balanced (``\\boxed{\\frac{3}{4}}`` gives ``\\frac{3}{4}``).
            - ``"last_number"``: the last number in the text (integer, decimal with optional ``1,000``
              grouping, or simple fraction ``a/b``; a leading minus when it is not a subtraction).

    Returns:
        Optional[str]: the extracted answer (not stripped), or None when there is none.

    Raises:
        ValueError: if ``mode`` is unknown.
    """
    if mode == "answer_tag":
        end = text.rfind(_ANSWER_CLOSE)
        if end < 0:
            return None
        start = text.rfind(_ANSWER_OPEN, 0, end)
        if start < 0:
            return None
        inner = text[start + len(_ANSWER_OPEN) : end]
        # Nested or garbled tags ("<answer><answer>4</answer></answer>") leave a tag inside: no answer.
        if _ANSWER_CLOSE in inner:
            return None
        return inner
    if mode == "boxed":
        # Stack of (is_box, content_start); a closing brace pops one level. The answer is the box that
        # closes last. Stray closing braces (empty stack) are ignored. One pass, linear in len(text).
        stack: List[tuple] = []
        found: Optional[str] = None
        for m in _BOX_TOKEN.finditer(text):
            tok = m.group()
            if tok == "}":
                if stack:
                    is_box, start = stack.pop()
                    if is_box:
                        found = text[start : m.start()]
            elif tok == "{":
                stack.append((False, 0))
            else:
                stack.append((True, m.end()))
        return found
    if mode == "last_number":
        last = None
        for last in _LAST_NUMBER.finditer(text):
            pass
        return None if last is None else last.group()
    raise ValueError(f"unknown extract mode {mode!r}; valid modes are {list(EXTRACT_MODES)}")
