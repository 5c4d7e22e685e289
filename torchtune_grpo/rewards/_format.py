"""The think/answer format reward (DeepSeek-R1 style, Guo et al. 2025, arXiv:2501.12948).

With the R1 prompt template the prompt itself ends with an opening ``<think>``, so a well-formed
completion looks like ``reasoning ... </think> <answer> 42 </answer>``. Checks use ``str.count`` and
``str.find`` only (no backtracking regex), so they are linear in the completion length.
"""

from typing import List, Sequence

from torchtune_grpo.rewards._base import Reward, RewardBatch

__all__ = ["DEFAULT_EOS_TEXT", "FormatReward", "follows_format"]

#: End-of-sequence markers that may be left at the end of a decoded completion (Qwen, Llama 3, Llama 2).
DEFAULT_EOS_TEXT = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"


def _strip_eos(text: str, eos_text: Sequence[str]) -> str:
    # Trailing whitespace and eos markers in any order and number ("...</answer>\n<|im_end|>").
    while True:
        stripped = text.rstrip()
        for eos in eos_text:
            if eos and stripped.endswith(eos):
                stripped = stripped[: -len(eos)]
                break
        else:
            return stripped
        text = stripped


def follows_format(
    text: str,
    *,
    strict: bool = False,
    think_in_prompt: bool = True,
    eos_text: Sequence[str] = DEFAULT_EOS_TEXT,
) -> bool:
    """Whether a completion follows the think/answer format.

    Common rules: exactly one ``</think>``, ``<answer>`` and ``</answer>``, in that order; no ``<think>``
    when ``think_in_prompt`` (it is already in the prompt, so another one is a nested block), else exactly
    one, before everything else; the answer is not blank. So nested or repeated tags fail.

    Non-strict (``strict=False``): any whitespace (newlines included) before ``<think>`` and between
    ``</think>`` and ``<answer>``; the answer may have any surrounding whitespace; text after ``</answer>``
    is allowed (it holds no tags, by the counts above). The reasoning may be empty.

    Strict (``strict=True``): ``[<think>]reasoning</think>\\n<answer>\\nANSWER\\n</answer>`` exactly,
    with non-blank reasoning, nothing before ``<think>``, and only whitespace or eos markers after
    ``</answer>``.

    Args:
        text (str): the completion.
        strict (bool): apply the strict layout. Default is False.
        think_in_prompt (bool): the prompt already ends with ``<think>`` (R1 template). Default is True.
        eos_text (Sequence[str]): end-of-sequence markers ignored at the end of the text.
            Default is :data:`DEFAULT_EOS_TEXT`.

    Returns:
        bool: True when the format is followed.
    """
    if not text:
        return False
    text = _strip_eos(text, eos_text)
    expected = {
        _THINK_OPEN: 0 if think_in_prompt else 1,
        _THINK_CLOSE: 1,
        _ANSWER_OPEN: 1,
        _ANSWER_CLOSE: 1,
    }
    if any(text.count(tag) != n for tag, n in expected.items()):
        return False
    think_close = text.find(_THINK_CLOSE)
    answer_open = text.find(_ANSWER_OPEN)
    answer_close = text.find(_ANSWER_CLOSE)
    if think_in_prompt:
        head, reasoning = "", text[:think_close]
    else:
        think_open = text.find(_THINK_OPEN)
        if think_open > think_close:
            return False
        head, reasoning = text[:think_open], text[think_open + len(_THINK_OPEN) : think_close]
    if not think_close < answer_open < answer_close:
        return False
    between = text[think_close + len(_THINK_CLOSE) : answer_open]
    answer = text[answer_open + len(_ANSWER_OPEN) : answer_close]
    tail = text[answer_close + len(_ANSWER_CLOSE) :]
    if not answer.strip():
        return False
    if not strict:
        return not head.strip() and not between.strip()
    return (
        head == ""
        and bool(reasoning.strip())
        and between == "\n"
        and answer.startswith("\n")
        and answer.endswith("\n")
        and not tail.strip()
    )


class FormatReward(Reward):
    """1.0 when a completion follows the think/answer format, else 0.0 (see :func:`follows_format`).

    Args:
        strict (bool): require exactly ``...</think>\\n<answer>\\n...\\n</answer>`` with nothing after but
            whitespace or eos markers. Default is False (whitespace-tolerant; text after ``</answer>``
            allowed).
        think_in_prompt (bool): the prompt ends with ``<think>`` (R1 template), so the completion must not
            open another one; when False the completion must start with ``<think>``. Default is True.
        eos_text (Sequence[str]): end-of-sequence markers ignored at the end of a completion.
            Default is :data:`DEFAULT_EOS_TEXT`.
    """

    def __init__(
        self,
        strict: bool = False,
        think_in_prompt: bool = True,
        eos_text: Sequence[str] = DEFAULT_EOS_TEXT,
    ) -> None:
        self.strict = strict
        self.think_in_prompt = think_in_prompt
        self.eos_text = tuple(eos_text)

    def __call__(self, batch: RewardBatch) -> List[float]:
        return [
            1.0
            if follows_format(
                c or "", strict=self.strict, think_in_prompt=self.think_in_prompt, eos_text=self.eos_text
            )
            else 0.0
            for c in batch.completions
        ]
