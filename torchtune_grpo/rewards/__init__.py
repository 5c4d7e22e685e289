"""Rewards: callables ``reward(batch: RewardBatch) -> List[float]`` and :class:`RewardSet` to combine them.

Each reward is a YAML ``_component_``; the recipe builds the weighted set with :func:`build_reward_set`.
See docs/rewards.md for writing, testing and weighting rewards.
"""

from torchtune_grpo.rewards._base import (
    DEFAULT_REWARD_TIMEOUT,
    NO_TIMEOUT,
    OPTION_KEYS,
    Reward,
    RewardBatch,
    RewardOutput,
    RewardSample,
    Steps,
    reward_name,
    to_plain,
)
from torchtune_grpo.rewards._reward_set import build_reward_set, RewardOutputError, RewardSet
from torchtune_grpo.rewards._length import SoftOverlongPunishment
from torchtune_grpo.rewards._column_steps import column_addition_step
from torchtune_grpo.rewards._code import CODE_EXTRACT_MODES, CodeExecutionReward, extract_code
from torchtune_grpo.rewards._execution import RewardTimeoutError
from torchtune_grpo.rewards._format import DEFAULT_EOS_TEXT, FormatReward, follows_format
from torchtune_grpo.rewards._http_judge import HTTPJudge, JudgeRequestError
from torchtune_grpo.rewards._judge import DEFAULT_RUBRIC, DEFAULT_YES_NO_RUBRIC, parse_score, rubric_fields
from torchtune_grpo.rewards._match import ContainsReward, ExactMatchReward
from torchtune_grpo.rewards._math import (
    BACKENDS,
    EXTRACT_MODES,
    MathAnswerReward,
    answers_match,
    extract_answer,
    math_verify_available,
    math_verify_match,
    normalize_text,
    parse_number,
)
from torchtune_grpo.rewards._model_judge import JUDGE_METHODS, ModelJudge
from torchtune_grpo.rewards._python import PythonReward, load_function, python_reward
from torchtune_grpo.rewards._steps import (
    AGGREGATES,
    PythonStepReward,
    StepReward,
    StepSpan,
    StepSplitter,
    aggregate_steps,
    token_offsets,
)
from torchtune_grpo.rewards._prm import HTTPStepReward, PRM_HEADS, PRMStepReward
from torchtune_grpo.rewards._sandbox import (
    NETWORK_MODES,
    ProgramResult,
    SandboxResult,
    network_namespace_available,
    normalize_tests,
    run_python_program,
    run_python_tests,
)

__all__ = [
    "AGGREGATES",
    "HTTPStepReward",
    "PRMStepReward",
    "PRM_HEADS",
    "PythonStepReward",
    "StepReward",
    "StepSpan",
    "StepSplitter",
    "Steps",
    "aggregate_steps",
    "token_offsets",
    "BACKENDS",
    "CODE_EXTRACT_MODES",
    "CodeExecutionReward",
    "ContainsReward",
    "DEFAULT_EOS_TEXT",
    "DEFAULT_RUBRIC",
    "DEFAULT_YES_NO_RUBRIC",
    "EXTRACT_MODES",
    "ExactMatchReward",
    "FormatReward",
    "HTTPJudge",
    "JUDGE_METHODS",
    "JudgeRequestError",
    "MathAnswerReward",
    "ModelJudge",
    "NETWORK_MODES",
    "DEFAULT_REWARD_TIMEOUT",
    "NO_TIMEOUT",
    "OPTION_KEYS",
    "ProgramResult",
    "PythonReward",
    "Reward",
    "RewardBatch",
    "RewardOutput",
    "RewardOutputError",
    "RewardSample",
    "RewardSet",
    "RewardTimeoutError",
    "SandboxResult",
    "SoftOverlongPunishment",
    "answers_match",
    "build_reward_set",
    "column_addition_step",
    "extract_answer",
    "extract_code",
    "follows_format",
    "load_function",
    "math_verify_available",
    "math_verify_match",
    "network_namespace_available",
    "normalize_tests",
    "normalize_text",
    "parse_number",
    "parse_score",
    "python_reward",
    "reward_name",
    "to_plain",
    "rubric_fields",
    "run_python_program",
    "run_python_tests",
]
