"""A small OpenEnv environment shipped with the package: arithmetic drills with a second try (docs/environments.md).

The server side of OpenEnv (``openenv-core``'s ``Environment`` and ``create_app``), served by uvicorn as
``torchtune_grpo.envs.openenv_arithmetic:app``. :class:`~torchtune_grpo.envs.OpenEnvEnvironment` starts it itself
when a config names ``app: torchtune_grpo.envs.openenv_arithmetic:app`` instead of a ``base_url``.

One episode: ``reset(seed)`` poses ``What is a + b?`` (the seed decides ``a`` and ``b``, so a group of episodes
reset with one seed sees one problem); each ``step`` reads the last integer of the action's ``message``. Right:
reward 1, done. Wrong: reward 0, and the observation asks again, until ``max_attempts`` answers were given.
Concurrent sessions: each WebSocket gets its own instance (``OPENENV_MAX_CONCURRENT_ENVS``, default 256).
"""

import os
import random
import re
from typing import Any, Optional

from torchtune_grpo.envs._extras import require

require("openenv", "torchtune_grpo.envs.openenv_arithmetic")

from openenv.core import Action, Environment, Observation, State, create_app  # noqa: E402 - after the check

__all__ = ["ArithmeticAction", "ArithmeticDrill", "ArithmeticObservation", "app"]

_INTEGER = re.compile(r"-?\d+")


class ArithmeticAction(Action):
    """The model's turn, as text."""

    message: str


class ArithmeticObservation(Observation):
    """The problem or the feedback, as text (``done`` and ``reward`` come with every OpenEnv observation)."""

    message: str


class ArithmeticDrill(Environment):
    """``What is a + b?`` with operands in ``[0, max_value]`` drawn from the reset seed; ``max_attempts`` answers.

    Args:
        max_value (int): the largest operand. Default is 20.
        max_attempts (int): answers per episode. Default is 2.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own instance and no shared state

    def __init__(self, max_value: int = 20, max_attempts: int = 2) -> None:
        super().__init__()
        self.max_value, self.max_attempts = max_value, max_attempts
        self._state = State()
        self.answer, self.attempts = 0, 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> ArithmeticObservation:
        rng = random.Random(seed)
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        self.answer, self.attempts = a + b, 0
        self._state = State(episode_id=episode_id, step_count=0)
        return ArithmeticObservation(message=f"What is {a} + {b}?", done=False, reward=None)

    def step(self, action: ArithmeticAction, timeout_s: Optional[float] = None, **kwargs: Any) -> ArithmeticObservation:
        self.attempts += 1
        self._state.step_count += 1
        numbers = _INTEGER.findall(action.message)
        if numbers and int(numbers[-1]) == self.answer:
            return ArithmeticObservation(message="Correct.", done=True, reward=1.0)
        done = self.attempts >= self.max_attempts
        return ArithmeticObservation(message="Not quite. Try again: answer with the number.", done=done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    ArithmeticDrill, ArithmeticAction, ArithmeticObservation, env_name="arithmetic_drill",
    max_concurrent_envs=int(os.environ.get("OPENENV_MAX_CONCURRENT_ENVS", "256")),
)
