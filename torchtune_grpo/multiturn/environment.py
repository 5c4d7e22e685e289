"""The environment a multi-turn episode talks to, and stepping many episodes at once with time limits.

An environment is a YAML ``_component_`` with two methods, each either a plain function or ``async def``:

- ``start(fields) -> state``: a new episode for one prompt; ``fields`` are the prompt's dataset columns
  (``answer``...). ``state`` is anything the environment wants back at each step.
- ``step(state, message) -> EnvReply``: the model's turn (``{"role": "assistant", "content": text}``) in,
  the environment's reply out: messages to append (tool results as ``role: "tool"``, observations as
  ``role: "user"``), whether the episode is over, and an info dict that rewards can read.

:func:`step_episodes` runs one call per episode concurrently (coroutines on one event loop, plain functions
in threads), each with its own timeout. A call that raises or times out ends that episode with an
:class:`EnvOutcome` error instead of raising: the rollout counts it and the episode gets the configured
fallback reward; the run goes on. (Python cannot stop a thread: a plain function that never returns keeps
its thread; ``async def`` environments are cancelled properly.)
"""

import asyncio
import inspect
import threading
from typing import (
    Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Protocol, Sequence, Union, runtime_checkable,
)

from torchtune_grpo.multiturn.tools import build_tool, Tool, ToolBox, ToolResult, parse_tool_calls

__all__ = ["EnvOutcome", "EnvReply", "Environment", "ToolEnvironment", "start_episodes", "step_episodes"]


class EnvReply(NamedTuple):
    """The environment's answer to one model turn.

    Attributes:
        messages (List[Dict[str, Any]]): appended to the conversation, in order (``role`` ``"tool"`` or
            ``"user"``, ``content`` text). Empty when ``done``.
        done (bool): the episode is over (the model's last turn was its final answer).
        info (Dict[str, Any]): numbers or facts about this step (tool calls, errors...), passed to rewards.
    """

    messages: List[Dict[str, Any]]
    done: bool
    info: Dict[str, Any] = {}


class EnvOutcome(NamedTuple):
    """What calling the environment for one episode gave: a value, or an error that ended the episode.

    Attributes:
        value (Any): the state (from ``start``) or the :class:`EnvReply` (from ``step``); None on error.
        error (str): ``""``, or ``"<kind>: <message>"`` with kind ``exception`` or ``timeout``.
    """

    value: Any
    error: str = ""


@runtime_checkable
class Environment(Protocol):
    """What the multi-turn rollout asks of an environment (see the module docstring)."""

    def start(self, fields: Dict[str, Any]) -> Any: ...

    def step(self, state: Any, message: Dict[str, Any]) -> EnvReply: ...


def _in_daemon_thread(fn: Callable[..., Any], args: tuple) -> "asyncio.Future[Any]":
    """``fn(*args)`` in a daemon thread, as a future of the running loop.

    Not ``asyncio.to_thread``: ``asyncio.run`` joins the default executor's threads when it ends, so a
    plain-function environment that never returns would hang the rollout after its timeout. A daemon
    thread is abandoned instead (and cannot keep the process alive at exit).
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: Optional[BaseException]) -> None:
        if future.done():  # timed out and cancelled already
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def target() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            error = e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:
            pass  # the loop is closed: nobody waits for this answer any more

    threading.Thread(target=target, name="environment-call", daemon=True).start()
    return future


async def _call(fn: Callable[..., Any], args: tuple, timeout: Optional[float]) -> EnvOutcome:
    awaitable = fn(*args) if inspect.iscoroutinefunction(fn) else _in_daemon_thread(fn, args)
    try:
        value = await asyncio.wait_for(awaitable, timeout)
        if inspect.isawaitable(value):  # a plain function that returned a coroutine
            value = await asyncio.wait_for(value, timeout)
        return EnvOutcome(value)
    except asyncio.TimeoutError:
        return EnvOutcome(None, f"timeout: no answer within {timeout} s")
    except Exception as e:  # noqa: BLE001 - an environment must never crash the run
        return EnvOutcome(None, f"exception: {type(e).__name__}: {e}")


def _run_all(fn: Callable[..., Any], arg_lists: Sequence[tuple], timeout: Optional[float]) -> List[EnvOutcome]:
    async def gather() -> List[EnvOutcome]:
        return await asyncio.gather(*(_call(fn, args, timeout) for args in arg_lists))

    return asyncio.run(gather())


def start_episodes(env: Environment, fields: Sequence[Dict[str, Any]], timeout: Optional[float]) -> List[EnvOutcome]:
    """``env.start(f)`` for every prompt's fields, concurrently, each limited to ``timeout`` seconds."""
    return _run_all(env.start, [(f,) for f in fields], timeout)


def step_episodes(
    env: Environment, states: Sequence[Any], messages: Sequence[Dict[str, Any]], timeout: Optional[float]
) -> List[EnvOutcome]:
    """``env.step(state, message)`` for every live episode, concurrently, each limited to ``timeout`` s.

    A returned value that is not an :class:`EnvReply` is an error (``exception: ...``) for that episode.
    """
    outcomes = _run_all(env.step, list(zip(states, messages)), timeout)
    return [
        o if o.error or isinstance(o.value, EnvReply)
        else EnvOutcome(None, f"exception: step returned {type(o.value).__name__}, not EnvReply")
        for o in outcomes
    ]


class ToolEnvironment:
    """The built-in environment for tool use: each turn's tool calls are run and their results returned.

    A turn without a tool call is the final answer and ends the episode. Malformed calls are answered with
    an error message (the model may correct itself) and counted in ``info["tool_errors"]``.

    Args:
        tools (Sequence[Union[Tool, str, Mapping[str, Any]]]): the tools: :class:`Tool` objects, or, from a
            YAML config, the dotted path of a function returning one (``torchtune_grpo.multiturn.Calculator``)
            or ``{_component_: path, **kwargs}`` (torchtune's config does not build nested components).
        max_calls_per_turn (int): calls beyond this many in one turn are answered with an error.
            Default is 4.
        max_result_chars (int): see :class:`ToolBox`. Default is 2000.
    """

    def __init__(
        self, tools: Sequence[Union[Tool, str, Mapping[str, Any]]], max_calls_per_turn: int = 4,
        max_result_chars: int = 2000,
    ) -> None:
        if int(max_calls_per_turn) < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.toolbox = ToolBox([build_tool(t) for t in tools], max_result_chars=max_result_chars)
        self.max_calls_per_turn = int(max_calls_per_turn)
        # what the prompt's chat template renders (tools=), read by MultiTurn
        self.tools = self.toolbox.schemas()

    def start(self, fields: Dict[str, Any]) -> Dict[str, Any]:
        return {"fields": fields}

    def step(self, state: Dict[str, Any], message: Dict[str, Any]) -> EnvReply:
        calls = parse_tool_calls(message["content"])
        if not calls:
            return EnvReply([], True, {"tool_calls": 0, "tool_errors": 0})
        # Calls past the limit are not run, only answered, so one turn cannot start many slow tools.
        results = [self.toolbox.call(c) for c in calls[: self.max_calls_per_turn]]
        over = f"Error: at most {self.max_calls_per_turn} tool calls per turn; this one was not run"
        results += [ToolResult(c.name, over, "too_many_calls") for c in calls[self.max_calls_per_turn :]]
        replies = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
        errors = sum(not r.ok for r in results)
        return EnvReply(replies, False, {"tool_calls": len(results), "tool_errors": errors})
