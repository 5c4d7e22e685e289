"""Answer extraction, exact numeric comparison and the math correctness reward.

:class:`MathAnswerReward` compares with the built-in exact comparison below and, when the optional
``math-verify`` package is installed (``pip install 'torchtune-grpo[math]'``), also with math-verify's
symbolic LaTeX equivalence.

Numbers are compared exactly, as :class:`fractions.Fraction`, never with a float tolerance: ``0.1 + 0.2``
style rounding cannot make a wrong answer right, and ``3/4`` equals ``0.75`` exactly.

Everything here must survive any text a policy can produce (empty strings, 100k-character completions,
thousands of digits, non-ASCII digits) without raising and in time linear in the text length:

- :func:`parse_number` gives up (returns None) on strings longer than :data:`MAX_NUMBER_CHARS` or with an
  exponent beyond :data:`MAX_EXPONENT`, so no huge integer is ever built (Python also refuses to parse
  integers of more than 4300 digits by default).
- Unicode decimal digits (category Nd: Arabic-Indic ``٤٢``, full-width ``４２``, ...) are read as the digits
  they are, via :func:`unicodedata.decimal`: ``"٤٢"`` parses as 42. Other digit-like characters (``²``,
  ``½``, ``Ⅻ``) are not numbers.
"""

import logging
import re
import threading
import unicodedata
from fractions import Fraction
from typing import Any, Dict, List, Optional

from torchtune_grpo.rewards._base import NO_TIMEOUT, Reward, RewardBatch
from torchtune_grpo.rewards.answers import extract_answer, EXTRACT_MODES

__all__ = [
    "BACKENDS",
    "EXTRACT_MODES",
    "MAX_EXPONENT",
    "MAX_NUMBER_CHARS",
    "MathAnswerReward",
    "answers_match",
    "extract_answer",
    "math_verify_available",
    "math_verify_match",
    "normalize_text",
    "parse_number",
]

#: Strings longer than this (after stripping surrounding whitespace) are not parsed as numbers.
MAX_NUMBER_CHARS = 200
#: Largest accepted decimal exponent magnitude (``1e100``); beyond it the text is not a number.
MAX_EXPONENT = 100
#: Valid ``backend`` values of :class:`MathAnswerReward`.
BACKENDS = ("auto", "math_verify", "builtin")
#: Answers longer than this are not handed to math-verify (sympy parsing of huge text is slow).
MAX_MATH_VERIFY_CHARS = 1000

log = logging.getLogger(__name__)

# Fully ASCII after normalisation: sign, integer part (plain or 3-digit comma groups), fraction, exponent.
_DECIMAL = re.compile(r"([+-]?)(\d{1,3}(?:,\d{3})+|\d+)?(?:\.(\d+))?(?:[eE]([+-]?\d+))?", re.ASCII)
_LATEX_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _ascii_digits(s: str) -> str:
    if s.isascii():
        return s
    # Unicode decimal digits -> ASCII; U+2212 MINUS SIGN -> '-'. Everything else is left alone.
    return "".join(
        str(unicodedata.decimal(c)) if c.isdecimal() else ("-" if c == "\u2212" else c) for c in s
    )


def _parse_decimal(s: str) -> Optional[Fraction]:
    m = _DECIMAL.fullmatch(s)
    if m is None:
        return None
    sign, int_part, frac_part, exp = m.groups()
    if int_part is None and frac_part is None:
        return None
    digits = (int_part or "0").replace(",", "") + (frac_part or "")
    value = Fraction(int(digits), 10 ** len(frac_part or ""))
    if exp is not None:
        e = int(exp)
        if abs(e) > MAX_EXPONENT:
            return None
        value *= Fraction(10) ** e
    return -value if sign == "-" else value


def _ratio(num: str, den: str, sign: str = "") -> Optional[Fraction]:
    a, b = _parse_decimal(num.strip()), _parse_decimal(den.strip())
    if a is None or b is None or b == 0:
        return None
    value = a / b
    return -value if sign == "-" else value


def parse_number(text: str) -> Optional[Fraction]:
    """Parses a final answer as an exact number, or returns None when it is not one.

    Accepted, all compared exactly: ``"1000"``, ``" 1000 "``, ``"1,000"`` (comma groups of 3 only),
    ``"1000.0"``, ``"1000."`` (a trailing period), ``"$1000"`` and ``"\\$1000"``, ``"50%"`` (the percent
    sign is dropped, so it equals ``"50"``, not ``"0.5"``), ``"-3"``, ``"+3"``, ``"3/4"`` and
    ``"\\frac{3}{4}"`` (``\\dfrac``, ``\\tfrac``), ``"1.5e3"`` (exponent at most :data:`MAX_EXPONENT`),
    ``"\\text{42}"``, and Unicode decimal digits (``"٤٢"`` is 42).

    Not numbers (None): empty text, words (``"42 apples"``), ``"1,5"`` (not 3-digit groups), expressions,
    division by zero, and anything longer than :data:`MAX_NUMBER_CHARS` characters.

    Args:
        text (str): the extracted answer.

    Returns:
        Optional[Fraction]: the exact value, or None.
    """
    if not isinstance(text, str):
        text = str(text)
    s = text.strip()
    if not s or len(s) > MAX_NUMBER_CHARS:
        return None
    s = _ascii_digits(s)
    # LaTeX wrappers models put around numbers: \text{..}, \$, \%, thin spaces and {,} separators.
    s = _LATEX_TEXT.sub(r"\1", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "%")
    s = s.replace("{,}", ",").replace("\\,", "").replace("\\!", "").strip()
    if s.endswith("."):
        s = s[:-1].rstrip()
    if s.endswith("%"):
        s = s[:-1].rstrip()
    if not s:
        return None
    m = _LATEX_FRAC.fullmatch(s)
    if m is not None:
        return _ratio(m.group(2), m.group(3), m.group(1))
    if s.count("/") == 1:
        num, den = s.split("/")
        return _ratio(num, den)
    return _parse_decimal(s)


def normalize_text(text: str) -> str:
    """Normalises a non-numeric answer for string comparison: strip, lowercase, collapse whitespace.

    Args:
        text (str): an answer.

    Returns:
        str: the normalised answer.
    """
    return " ".join(str(text).split()).lower()


def answers_match(prediction: str, gold: str) -> bool:
    """Whether an extracted answer equals the gold answer.

    Both sides are compared exactly as numbers (see :func:`parse_number`) when both parse; otherwise their
    :func:`normalize_text` forms must be equal.

    Args:
        prediction (str): the extracted answer.
        gold (str): the gold answer.

    Returns:
        bool: True when they match.
    """
    p, g = parse_number(prediction), parse_number(gold)
    if p is not None and g is not None:
        return p == g
    return normalize_text(prediction) == normalize_text(gold)


def _import_math_verify() -> Any:
    """Returns the ``math_verify`` module, or None when it is not installed (or broken)."""
    try:
        import math_verify
    except Exception:  # noqa: BLE001 - ImportError, or a broken install: either way, not available
        return None
    return math_verify


def math_verify_available() -> bool:
    """Whether the optional ``math-verify`` package is importable (``pip install torchtune-grpo[math]``)."""
    return _import_math_verify() is not None


def _as_latex(answer: str) -> str:
    # math-verify extracts from LaTeX-delimited text; a bare "\frac{1}{2}" or "(1, 2)" needs the $...$.
    answer = answer.strip()
    if "$" in answer or "\\boxed" in answer or "\\(" in answer or "\\[" in answer:
        return answer
    return f"${answer}$"


def math_verify_match(prediction: str, gold: str, _cache: Optional[Dict[str, Any]] = None) -> bool:
    """Whether math-verify judges ``prediction`` equal to ``gold`` (symbolically, e.g. ``\\frac{\\sqrt2}{2}``
    equals ``\\sqrt{2}/2``). False when either side has no parsable expression, is longer than
    :data:`MAX_MATH_VERIFY_CHARS`, or math-verify fails.

    math-verify's own time limits use ``signal.alarm``, which works only in the main thread; elsewhere
    (per-sample reward threads) they are switched off and the caller's timeout applies.

    Args:
        prediction (str): the extracted answer.
        gold (str): the gold answer.

    Returns:
        bool: True when math-verify says they are equal.

    Raises:
        ImportError: if math-verify is not installed.
    """
    mv = _import_math_verify()
    if mv is None:
        raise ImportError("math-verify is not installed: pip install 'torchtune-grpo[math]'")
    if len(prediction) > MAX_MATH_VERIFY_CHARS or len(gold) > MAX_MATH_VERIFY_CHARS:
        return False
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    try:
        key = gold
        if _cache is not None and key in _cache:
            g = _cache[key]
        else:
            g = mv.parse(_as_latex(gold), parsing_timeout=limit)
            if _cache is not None:
                _cache[key] = g
        if not g:
            return False
        p = mv.parse(_as_latex(prediction), parsing_timeout=limit)
        if not p:
            return False
        return bool(mv.verify(g, p, timeout_seconds=limit))
    except Exception as e:  # noqa: BLE001 - a parser failure on model text is a mismatch, not an error
        log.debug("math-verify failed on %r vs %r: %s", prediction[:100], gold[:100], e)
        return False


class MathAnswerReward(Reward):
    """1.0 when the completion's final answer equals the gold answer ``fields[i][answer_key]``, else 0.0.

    The answer is extracted with :func:`extract_answer` (``<answer>`` tags, the last ``\\boxed{}``, or the
    last number, as configured), then compared:

    - always with the built-in exact comparison :func:`answers_match` (exact numbers as fractions, else
      normalised strings);
    - and, with the ``math_verify`` backend, also with math-verify (symbolic LaTeX equivalence:
      ``\\frac{1}{2}`` = ``0.5``, ``\\sqrt{2}/2`` = ``\\frac{\\sqrt{2}}{2}``, intervals, sets...).

    The answer is correct when either says so. A completion with nothing (or only whitespace) to extract
    scores 0.0. Never raises on completion text; a missing gold answer raises KeyError (a dataset bug,
    which :class:`RewardSet` turns into a logged fallback).

    Args:
        extract (str): ``"answer_tag"``, ``"boxed"`` or ``"last_number"`` (see :func:`extract_answer`).
            Default is ``"answer_tag"``.
        answer_key (str): the dataset field holding the gold answer. Default is ``"answer"``.
        backend (str): ``"auto"`` (math-verify when installed, else built-in), ``"math_verify"`` (required)
            or ``"builtin"``. Default is ``"auto"``.

    Raises:
        ValueError: if ``extract`` or ``backend`` is unknown.
        ImportError: if ``backend="math_verify"`` and math-verify is not installed.
    """

    def __init__(self, extract: str = "answer_tag", answer_key: str = "answer", backend: str = "auto") -> None:
        if extract not in EXTRACT_MODES:
            raise ValueError(f"unknown extract mode {extract!r}; valid modes are {list(EXTRACT_MODES)}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; valid backends are {list(BACKENDS)}")
        available = math_verify_available()
        if backend == "math_verify" and not available:
            raise ImportError(
                "MathAnswerReward(backend='math_verify') needs math-verify: pip install 'torchtune-grpo[math]'"
            )
        self.extract = extract
        self.answer_key = answer_key
        self.backend = "math_verify" if backend == "math_verify" or (backend == "auto" and available) else "builtin"
        if self.backend == "math_verify":
            # math-verify bounds each parse and comparison itself (5 s, with signal.alarm), which works only
            # in the main thread: RewardSet's default limit would move the call to a worker thread and trade
            # those per-expression limits for one limit on the whole batch. An explicit `timeout` still applies.
            self.timeout = NO_TIMEOUT
        if backend == "auto" and not available:
            log.warning(
                "MathAnswerReward(backend='auto'): math-verify is not installed, so answers are compared with "
                "the built-in exact comparison only (pip install 'torchtune-grpo[math]' for symbolic "
                "equivalence, or set backend: builtin to silence this)."
            )

    def _score(self, completion: str, fields: Dict[str, Any], cache: Dict[str, Any]) -> float:
        if self.answer_key not in fields:
            raise KeyError(f"dataset fields have no gold answer {self.answer_key!r}: {sorted(fields)}")
        pred = extract_answer(completion or "", self.extract)
        # A blank answer never matches, even a blank gold answer.
        if pred is None or pred.strip() == "":
            return 0.0
        gold = str(fields[self.answer_key])
        if answers_match(pred, gold):
            return 1.0
        if self.backend == "math_verify" and math_verify_match(pred, gold, cache):
            return 1.0
        return 0.0

    def __call__(self, batch: RewardBatch) -> List[float]:
        cache: Dict[str, Any] = {}  # parsed gold answers: each is repeated group_size times
        return [self._score(c, f, cache) for c, f in zip(batch.completions, batch.fields)]

    def score_one(self, sample: Any) -> float:
        return self._score(sample.completion, sample.fields, {})
