"""Rewards used only by tests.

A randomly initialised model never produces a correct answer, so its format/correctness rewards are all
zero and GRPO has no signal. This reward varies between any two samples, which guarantees non-zero
advantages and therefore a real parameter update in recipe tests.
"""

from typing import List

from torchtune_grpo.rewards import RewardBatch


class VowelFractionReward:
    """Fraction of a completion's characters that are ASCII vowels (0 for an empty completion)."""

    name = "vowels"

    def __call__(self, batch: RewardBatch) -> List[float]:
        return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in batch.completions]
