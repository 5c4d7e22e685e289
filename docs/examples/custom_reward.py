"""The worked example of docs/rewards.md: a custom reward written as plain Python functions.

Use it from YAML with either form:

    reward_functions:
      - _component_: torchtune_grpo.rewards.python_reward
        function: docs/examples/custom_reward.py:concise_correct   # a file path (relative to the cwd)
        function_kwargs: {max_words: 50}
        weight: 1.0
        timeout: 2.0
        fallback: 0.0

tests/test_rewards_python.py imports this file and checks every number in the docstrings below.
"""

import asyncio
from typing import List, Optional

from torchtune_grpo.rewards import answers_match, extract_answer


def concise_correct(completions: List[str], answer: List[str], max_words: int = 200) -> List[float]:
    """Correct answers score 1.0 when short, less when long; wrong or missing answers score 0.0.

    The answer is read from the last ``<answer>...</answer>`` block and compared with the dataset's
    ``answer`` column. A correct completion of ``w`` words scores ``1.0`` up to ``max_words`` words,
    then falls linearly to ``0.5`` at ``2 * max_words`` words and stays there.

    Examples with ``max_words=4``::

        "x </think> <answer>42</answer>"            3 words, correct  -> 1.0
        "a b c d e f </think> <answer>42</answer>"  8 words, correct  -> 0.5
        "a b c d </think> <answer>42</answer>"      6 words, correct  -> 1.0 - 0.5 * (6 - 4) / 4 = 0.75
        "x </think> <answer>41</answer>"            wrong             -> 0.0
        ""                                          no answer         -> 0.0

    Args:
        completions (List[str]): the completions of the batch.
        answer (List[str]): the gold answers, the dataset's ``answer`` column (one per completion).
        max_words (int): the length with no penalty. Default is 200.

    Returns:
        List[float]: one score per completion.
    """
    scores = []
    for text, gold in zip(completions, answer):
        predicted: Optional[str] = extract_answer(text or "", "answer_tag")
        if predicted is None or not answers_match(predicted, gold):
            scores.append(0.0)
            continue
        words = len(text.split())
        over = max(0, words - max_words) / max_words
        scores.append(1.0 - 0.5 * min(over, 1.0))
    return scores


async def polite(completions: List[str], **columns) -> List[float]:
    """An ``async def`` reward (e.g. one that would await an HTTP service): 1.0 when the completion says
    "please" or "thank", else 0.0. ``**columns`` receives every column (``prompts``, ``answer``...)."""
    await asyncio.sleep(0)  # stands in for awaiting a remote call
    return [1.0 if ("please" in c.lower() or "thank" in c.lower()) else 0.0 for c in completions]
