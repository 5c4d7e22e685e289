"""Tasks and environments from the ecosystem: reasoning-gym, OpenEnv and verifiers (docs/environments.md).

Each adapter is a YAML ``_component_`` of the kind the recipe already builds (a prompt dataset, a reward, a
multi-turn environment), and each library is an optional extra imported only when its adapter is used:
``pip install "torchtune-grpo[reasoning-gym]"`` (or ``[openenv]``, ``[verifiers]``); a missing one raises
:class:`MissingExtraError` naming the extra.
"""

import importlib
from typing import Any

# Each name and the submodule that defines it, imported on first use (PEP 562): a process that needs one
# adapter does not import the others, nor what they import. The bundled OpenEnv server
# (``torchtune_grpo.envs.openenv_arithmetic:app``, one process per trainer rank) needs openenv alone; importing
# every adapter here would add the project's data stack and torchtune (seconds) to each server's start-up.
_WHERE = {
    "EpisodeInfoReward": ("_episode_reward", "EpisodeInfoReward"),
    "EXTRAS": ("_extras", "EXTRAS"),
    "MissingExtraError": ("_extras", "MissingExtraError"),
    "require": ("_extras", "require"),
    "OpenEnvEnvironment": ("_openenv", "OpenEnvEnvironment"),
    "local_server": ("_openenv", "local_server"),
    "openenv_dataset": ("_openenv", "openenv_dataset"),
    "UNSUPPORTED_VERIFIERS_FEATURES": ("_verifiers", "UNSUPPORTED"),
    "UnsupportedVerifiersFeature": ("_verifiers", "UnsupportedVerifiersFeature"),
    "VerifiersEnvironment": ("_verifiers", "VerifiersEnvironment"),
    "VerifiersReward": ("_verifiers", "VerifiersReward"),
    "load_taskset": ("_verifiers", "load_taskset"),
    "verifiers_dataset": ("_verifiers", "verifiers_dataset"),
    "ReasoningGymReward": ("_reasoning_gym", "ReasoningGymReward"),
    "TaskSpec": ("_reasoning_gym", "TaskSpec"),
    "parse_tasks": ("_reasoning_gym", "parse_tasks"),
    "reasoning_gym_dataset": ("_reasoning_gym", "reasoning_gym_dataset"),
    "reasoning_gym_rows": ("_reasoning_gym", "reasoning_gym_rows"),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _WHERE[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_WHERE))


__all__ = sorted(_WHERE)
