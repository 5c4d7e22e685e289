"""Multi-turn episodes: tools, tool-call parsing and the environment interface (docs/multi_turn.md).

The rollout loop that drives them lives with the generation engines; this package is pure (no model).
"""

from torchtune_grpo.multiturn.environment import (
    EnvOutcome,
    EnvReply,
    Environment,
    ToolEnvironment,
    start_episodes,
    step_episodes,
)
from torchtune_grpo.multiturn.episodes import Episodes, MultiTurn, run_episodes
from torchtune_grpo.multiturn.tools import (
    TOOL_ERROR_KINDS,
    Calculator,
    PythonInterpreter,
    Tool,
    ToolBox,
    ToolCall,
    ToolResult,
    build_tool,
    calculate,
    parse_tool_calls,
)

__all__ = [
    "Calculator",
    "EnvOutcome",
    "EnvReply",
    "Episodes",
    "MultiTurn",
    "Environment",
    "TOOL_ERROR_KINDS",
    "PythonInterpreter",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolEnvironment",
    "ToolResult",
    "build_tool",
    "calculate",
    "parse_tool_calls",
    "run_episodes",
    "start_episodes",
    "step_episodes",
]
