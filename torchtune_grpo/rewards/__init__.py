"""Rewards: callables ``reward(batch: RewardBatch) -> List[float]`` and :class:`RewardSet` to combine them.

Each reward is a YAML ``_component_``; the recipe builds the weighted set with :func:`build_reward_set`.
"""

from torchtune_grpo.rewards._base import (
    Reward,
    RewardBatch,
    RewardOutput,
    RewardSet,
    build_reward_set,
    reward_name,
)
from torchtune_grpo.rewards._format import DEFAULT_EOS_TEXT, FormatReward, follows_format
from torchtune_grpo.rewards._math import (
    EXTRACT_MODES,
    MathAnswerReward,
    answers_match,
    extract_answer,
    normalize_text,
    parse_number,
)

__all__ = [
    "DEFAULT_EOS_TEXT",
    "EXTRACT_MODES",
    "FormatReward",
    "MathAnswerReward",
    "Reward",
    "RewardBatch",
    "RewardOutput",
    "RewardSet",
    "answers_match",
    "build_reward_set",
    "extract_answer",
    "follows_format",
    "normalize_text",
    "parse_number",
    "reward_name",
]
