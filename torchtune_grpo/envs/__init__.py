"""Tasks and environments from the ecosystem: reasoning-gym, OpenEnv and verifiers (docs/environments.md).

Each adapter is a YAML ``_component_`` of the kind the recipe already builds (a prompt dataset, a reward, a
multi-turn environment), and each library is an optional extra imported only when its adapter is used:
``pip install "torchtune-grpo[reasoning-gym]"`` (or ``[openenv]``, ``[verifiers]``); a missing one raises
:class:`MissingExtraError` naming the extra.
"""

from torchtune_grpo.envs._episode_reward import EpisodeInfoReward
from torchtune_grpo.envs._extras import EXTRAS, MissingExtraError, require
from torchtune_grpo.envs._openenv import OpenEnvEnvironment, local_server, openenv_dataset
from torchtune_grpo.envs._verifiers import (
    UNSUPPORTED as UNSUPPORTED_VERIFIERS_FEATURES,
    UnsupportedVerifiersFeature,
    VerifiersEnvironment,
    VerifiersReward,
    load_taskset,
    verifiers_dataset,
)
from torchtune_grpo.envs._reasoning_gym import (
    ReasoningGymReward,
    TaskSpec,
    parse_tasks,
    reasoning_gym_dataset,
    reasoning_gym_rows,
)

__all__ = [
    "EXTRAS",
    "EpisodeInfoReward",
    "MissingExtraError",
    "OpenEnvEnvironment",
    "ReasoningGymReward",
    "TaskSpec",
    "UNSUPPORTED_VERIFIERS_FEATURES",
    "UnsupportedVerifiersFeature",
    "VerifiersEnvironment",
    "VerifiersReward",
    "load_taskset",
    "local_server",
    "openenv_dataset",
    "parse_tasks",
    "reasoning_gym_dataset",
    "reasoning_gym_rows",
    "require",
    "verifiers_dataset",
]
