"""Rewards used only by tests.

A randomly initialised model never produces a correct answer, so its format/correctness rewards are all
zero and GRPO has no signal. These rewards vary between samples, which guarantees non-zero advantages and
therefore a real parameter update in recipe tests.
"""

import os
import time
from typing import List

from torchtune_grpo.rewards import RewardBatch


class VowelFractionReward:
    """Fraction of a completion's characters that are ASCII vowels (0 for an empty completion)."""

    name = "vowels"

    def __call__(self, batch: RewardBatch) -> List[float]:
        return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in batch.completions]


class EvenTokenReward:
    """Fraction of a completion's token ids that are even: a function of the ids alone (no tokenizer)."""

    name = "even_tokens"

    def __call__(self, batch: RewardBatch) -> List[float]:
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in batch.completion_ids]


class HalfPromptsVowelReward:
    """Vowel fraction for prompts of even length, 0 for the others: about half the groups have zero
    variance, so dynamic sampling has groups to drop and informative groups to keep."""

    name = "half_vowels"

    def __call__(self, batch: RewardBatch) -> List[float]:
        return [
            sum(c in "aeiou" for c in text) / max(len(text), 1) if len(prompt) % 2 == 0 else 0.0
            for prompt, text in zip(batch.prompts, batch.completions)
        ]


class HangWhileFileExists:
    """Vowel fraction, except that while the file ``path`` exists a call waits for it to go (an hour at most):
    a reward that hangs inside a generation worker, which stays alive and connected but stops answering."""

    name = "hang"

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, batch: RewardBatch) -> List[float]:
        deadline = time.monotonic() + 3600
        while os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        return VowelFractionReward()(batch)


def every_third_token(completion: str, completion_ids: List[int], token_offsets: List[int]) -> List[int]:
    """Step boundaries for tests: a step ends at every third token (the ids alone decide)."""
    return list(range(2, len(completion_ids), 3))


def vowel_step(step: str) -> float:
    """A step score for tests: the step's share of ASCII vowels (0 for an empty step)."""
    return sum(c in "aeiou" for c in step) / max(len(step), 1)
