"""verifiers tasksets as prompt datasets, rewards and tool environments (docs/environments.md).

Supported: verifiers 0.4.x, its ``verifiers.v1`` API (``pip install "torchtune-grpo[verifiers]"``). Releases before
0.4 (``SingleTurnEnv``/``MultiTurnEnv``/``ToolEnv`` with a ``Rubric``) are not: their API is gone from 0.4.

A v1 environment is a *taskset* (an installed package exporting one ``vf.Taskset`` subclass: its tasks, each with
a prompt and ``@vf.reward``/``@vf.metric``/``@vf.stop`` methods and optional ``Toolset``s of ``@vf.tool`` methods)
played by *agents* (a harness program calling a model endpoint). Here this project's engine is the agent: the
taskset is loaded the way verifiers loads it (``verifiers.v1.utils.loaders``: the id names the package, its
config class validates the settings), and

- :func:`verifiers_dataset` turns its tasks into prompts (the task's prompt text and system prompt, rendered by the
  project's chat formatting);
- :class:`VerifiersEnvironment` runs multi-turn tool episodes: the task's toolsets' ``@vf.tool`` methods are
  called in this process when the model calls them (Hermes ``<tool_call>`` format, as
  :class:`~torchtune_grpo.multiturn.ToolEnvironment`), and the episode ends at a turn without a call or when one
  of the task's ``@vf.stop`` conditions holds;
- :class:`VerifiersReward` scores an episode (or a single-turn completion) with the task's own scoring
  (``Task.score`` on a ``vf.Trace`` of the conversation): the weighted sum of its ``@vf.reward`` functions.

Refused by name, when the taskset is loaded (:data:`UNSUPPORTED`): multi-agent environments (an exported ``Env``
other than ``SingleAgentEnv``), the taskset's own harness, container tasks (``NEEDS_CONTAINER``), judges
(model-backed scoring), rewards, metrics or stop conditions that need a runtime, and prompts of several messages.
"""

import asyncio
import inspect
import json
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from torchtune_grpo.data import PromptDataset
from torchtune_grpo.envs._extras import require
from torchtune_grpo.multiturn import EnvReply, Tool, ToolEnvironment
from torchtune_grpo.rewards import Reward, RewardSample
from torchtune_grpo.rewards import to_plain

__all__ = ["UNSUPPORTED", "UnsupportedVerifiersFeature", "VerifiersEnvironment", "VerifiersReward", "load_taskset", "verifiers_dataset"]

#: verifiers features this adapter refuses, by the name used in its error messages.
UNSUPPORTED = (
    "multi-agent environments",
    "taskset harnesses",
    "container tasks",
    "judges",
    "runtime-dependent signals",
    "multi-message prompts",
)

_cache: Dict[str, Any] = {}
_cache_lock = threading.Lock()


class UnsupportedVerifiersFeature(ValueError):
    """The taskset uses a verifiers feature this adapter cannot run; the message names it."""


def _refuse(feature: str, taskset_id: str, detail: str) -> UnsupportedVerifiersFeature:
    return UnsupportedVerifiersFeature(
        f"verifiers taskset {taskset_id!r} uses {feature}, which torchtune_grpo.envs does not support ({detail}); "
        f"supported: single-agent tasksets whose tasks are scored by @vf.reward functions, with optional in-process "
        f"Toolsets (docs/environments.md)"
    )


def load_taskset(taskset: str, taskset_config: Optional[Mapping[str, Any]] = None):
    """The installed verifiers taskset ``taskset`` (its package name), loaded as verifiers loads it, and checked.

    Loaded once per process and settings (the dataset, environment and reward of a run share it).

    Args:
        taskset (str): the taskset id (an installed package exporting one ``vf.Taskset`` subclass via ``__all__``).
        taskset_config (Optional[Mapping[str, Any]]): its settings (``--env.taskset.*`` in verifiers' CLI),
            validated by the taskset's config class. Default is None.

    Returns:
        verifiers.v1.Taskset: the taskset.

    Raises:
        UnsupportedVerifiersFeature: (a ValueError) naming a feature in :data:`UNSUPPORTED`.
        MissingExtraError: when verifiers is not installed.
        ModuleNotFoundError: when no package of that id is installed (verifiers' own message).
    """
    require("verifiers", "torchtune_grpo.envs (verifiers tasksets)")
    from verifiers.v1 import SingleAgentEnv  # noqa: F401 - the only environment this adapter plays
    from verifiers.v1.utils.loaders import (
        default_harness_id, environment_class, taskset_class, taskset_config_type,
    )

    settings = to_plain(dict(taskset_config or {}))
    key = json.dumps([taskset, settings], sort_keys=True, default=str)
    with _cache_lock:
        if key in _cache:
            return _cache[key]
        env_cls = environment_class(taskset)
        if env_cls is not SingleAgentEnv:
            raise _refuse("multi-agent environments", taskset, f"it exports the Env {env_cls.__name__}, whose run() drives agents")
        if default_harness_id(taskset) != "bash":
            raise _refuse("taskset harnesses", taskset, "it exports its own Harness; here the trained model is the agent")
        config = taskset_config_type(taskset).model_validate({**settings, "id": taskset})
        loaded = taskset_class(taskset)(config)
        task_cls = type(loaded).task_type()
        if task_cls.NEEDS_CONTAINER:
            raise _refuse("container tasks", taskset, f"{task_cls.__name__}.NEEDS_CONTAINER is True")
        _cache[key] = loaded
        return loaded


def _tasks(taskset: str, taskset_config: Optional[Mapping[str, Any]], start: int, count: int) -> List[Any]:
    loaded = load_taskset(taskset, taskset_config)
    tasks = list(loaded.skip(start).take(count))
    for task in tasks:
        _check_task(task, taskset)
    return tasks


def _needs_runtime(fn: Callable[..., Any]) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _check_task(task, taskset: str) -> None:
    if task.config.judges:
        raise _refuse("judges", taskset, f"task {task.data.idx} plugs {len(task.config.judges)} judge(s), which call a model")
    needy = [fn.__name__ for kind in ("reward", "metric", "stop") for fn in task.hooks(kind) if _needs_runtime(fn)]
    if needy:
        raise _refuse("runtime-dependent signals", taskset, f"{needy} take a `runtime` (a sandbox this adapter has not)")


def _prompt(task, taskset: str) -> Tuple[str, Optional[str]]:
    """The task's prompt text and system prompt (a prompt of several messages is refused)."""
    prompt = task.data.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or getattr(prompt[0], "role", None) != "user":
            raise _refuse("multi-message prompts", taskset, f"task {task.data.idx} has {len(prompt)} prompt messages")
        prompt = task.data.prompt_text
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"verifiers taskset {taskset!r}: task {task.data.idx} has no prompt text")
    return prompt, task.data.system_prompt


def verifiers_dataset(
    tokenizer,
    taskset: str,
    taskset_config: Optional[Mapping[str, Any]] = None,
    num_tasks: int = 1000,
    start: int = 0,
    max_prompt_length: Optional[int] = 256,
    prompt_style: str = "chat",
    system_prompt: Optional[str] = None,
) -> PromptDataset:
    """Prompts from a verifiers taskset's tasks ``start .. start + num_tasks - 1`` (in its ``load()`` order).

    Args:
        tokenizer: a torchtune model tokenizer.
        taskset (str): the taskset id (:func:`load_taskset`).
        taskset_config (Optional[Mapping[str, Any]]): its settings. Default is None.
        num_tasks (int): tasks to take. Default is 1000.
        start (int): tasks to skip first (e.g. a validation range after the training one). Default is 0.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 256.
        prompt_style (str): ``"chat"`` or ``"r1"``. Default is ``"chat"``.
        system_prompt (Optional[str]): instruction text. Default is None: the tasks' own system prompt (they must
            all have the same one).

    Returns:
        PromptDataset: rows ``{tokens, prompt, answer: "", question, vf_idx}``.

    Raises:
        UnsupportedVerifiersFeature: naming a feature in :data:`UNSUPPORTED`.
        ValueError: when the tasks' system prompts differ and none is given, or the range is empty.
    """
    tasks = _tasks(taskset, taskset_config, int(start), int(num_tasks))
    if not tasks:
        raise ValueError(f"verifiers taskset {taskset!r} has no task in [{start}, {start + num_tasks})")
    prompts = [_prompt(t, taskset) for t in tasks]
    systems = {s for _, s in prompts}
    if system_prompt is None and len(systems) > 1:
        raise ValueError(f"verifiers taskset {taskset!r}: the tasks have {len(systems)} different system prompts; "
                         "set dataset.system_prompt (one prompt style renders one system prompt)")
    system = system_prompt if system_prompt is not None else next(iter(systems))
    rows = [{"question": p, "answer": "", "vf_idx": t.data.idx} for t, (p, _) in zip(tasks, prompts)]
    return PromptDataset(rows, tokenizer, formatter=prompt_style, max_prompt_length=max_prompt_length,
                         system_prompt=system, source_name=f"verifiers taskset {taskset!r}", required_columns=("question",))


class _Tasks:
    """The tasks of one taskset by index, loaded as far as the highest index asked for."""

    def __init__(self, taskset: str, taskset_config: Optional[Mapping[str, Any]]) -> None:
        self.taskset, self.config = taskset, to_plain(dict(taskset_config or {}))
        self.loaded = load_taskset(taskset, self.config)
        self._by_idx: Dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, idx: int):
        with self._lock:
            if idx not in self._by_idx:
                for task in self.loaded.take(idx + 1):
                    self._by_idx.setdefault(task.data.idx, task)
                if idx not in self._by_idx:
                    raise ValueError(f"verifiers taskset {self.taskset!r} has no task {idx}")
                _check_task(self._by_idx[idx], self.taskset)
            return self._by_idx[idx]


def _trace(task, messages: List[Dict[str, Any]]):
    """A ``vf.Trace`` of ``messages`` (system, user prompt, then the episode) for ``task``'s scoring and stops."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, ToolMessage, UserMessage

    def message(i: int, m: Dict[str, Any]):
        role, content = m["role"], m.get("content") or ""
        if role == "system":
            return SystemMessage(content=content)
        if role == "user":
            return UserMessage(content=content)
        if role == "assistant":
            return AssistantMessage(content=content)
        # this project's tool results carry no call id; verifiers needs one per message
        return ToolMessage(content=content, tool_call_id=f"call_{i}", name=m.get("name"))

    nodes = [MessageNode(parent=i - 1 if i else None, message=message(i, m), sampled=m["role"] == "assistant")
             for i, m in enumerate(messages)]
    return vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data), agent=AgentInfo(config=vf.AgentConfig()),
                    nodes=nodes, is_completed=True, ok=True)


def _history(task, taskset: str, episode: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    prompt, system = _prompt(task, taskset)
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}] + episode


class VerifiersReward(Reward):
    """The task's own scoring: the weighted sum of its ``@vf.reward`` functions over the episode's conversation.

    Single-turn completions are scored as one assistant message; multi-turn episodes as their whole conversation
    (``fields["conversation"]``: the model's turns and the tool results).

    Args:
        taskset (str): the taskset id (:func:`load_taskset`).
        taskset_config (Optional[Mapping[str, Any]]): its settings. Default is None.
        name (str): the component's name. Default is ``"verifiers"``.

    Raises:
        ValueError: (per sample: that sample gets the fallback) for a row without ``vf_idx``; a task's scoring error.
    """

    name = "verifiers"

    def __init__(self, taskset: str, taskset_config: Optional[Mapping[str, Any]] = None, name: str = "verifiers") -> None:
        self.tasks = _Tasks(taskset, taskset_config)
        self.name = name

    async def score_one(self, sample: RewardSample) -> float:
        if "vf_idx" not in sample.fields:
            raise ValueError(f"VerifiersReward needs the row column 'vf_idx' (torchtune_grpo.envs.verifiers_dataset "
                             f"writes it); this row has {sorted(sample.fields)}")
        task = self.tasks.get(int(sample.fields["vf_idx"]))
        episode = sample.fields.get("conversation") or [{"role": "assistant", "content": sample.completion}]
        trace = _trace(task, _history(task, self.tasks.taskset, list(episode)))
        await task.score(trace)
        return float(trace.reward)


def _json_schema(fn: Callable[..., Any]) -> Dict[str, Any]:
    """The JSON schema of ``fn``'s keyword arguments (pydantic, as MCP servers derive it)."""
    from pydantic import create_model

    fields = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        fields[name] = (annotation, ... if p.default is inspect.Parameter.empty else p.default)
    schema = create_model(f"{fn.__name__}_arguments", **fields).model_json_schema()
    schema.pop("title", None)
    return schema


def _run_sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(**kwargs: Any) -> Any:
        result = fn(**kwargs)
        # environment steps run in threads without an event loop: an async tool gets one of its own
        return asyncio.run(result) if inspect.isawaitable(result) else result

    return call


def _toolset_tools(task) -> List[Tool]:
    from verifiers.v1.utils.decorators import discover_decorated

    tools = []
    for toolset in type(task).toolsets(task.config):
        for fn in discover_decorated(toolset, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            tools.append(Tool(name, (fn.__doc__ or "").strip(), _json_schema(fn), _run_sync(fn)))
    return tools


class VerifiersEnvironment(ToolEnvironment):
    """Multi-turn tool episodes of a verifiers taskset (see the module docstring).

    The tools are the ``@vf.tool`` methods of the task class's ``Toolset``s (``Task.toolsets(config)``), called in
    this process; their schemas (from the methods' signatures) go into the prompts. The episode ends at a turn
    without a tool call, or when a ``@vf.stop`` method of the task returns True on the conversation so far.

    Args:
        taskset (str): the taskset id (:func:`load_taskset`).
        taskset_config (Optional[Mapping[str, Any]]): its settings. Default is None.
        max_calls_per_turn (int): see :class:`~torchtune_grpo.multiturn.ToolEnvironment`. Default is 4.

    Raises:
        UnsupportedVerifiersFeature: naming a feature in :data:`UNSUPPORTED`.
    """

    def __init__(self, taskset: str, taskset_config: Optional[Mapping[str, Any]] = None, max_calls_per_turn: int = 4) -> None:
        self.tasks = _Tasks(taskset, taskset_config)
        first = self.tasks.get(0)
        super().__init__(_toolset_tools(first), max_calls_per_turn=max_calls_per_turn)

    def start(self, fields: Dict[str, Any]) -> Dict[str, Any]:
        if "vf_idx" not in fields:
            raise ValueError(f"VerifiersEnvironment needs the row column 'vf_idx' (verifiers_dataset); row has {sorted(fields)}")
        return {"task": self.tasks.get(int(fields["vf_idx"])), "episode": []}

    def step(self, state: Dict[str, Any], message: Dict[str, Any]) -> EnvReply:
        reply = super().step(state, message)
        state["episode"] += [message] + list(reply.messages)
        if reply.done:
            return reply
        task = state["task"]
        stops = task.hooks("stop")
        if stops:
            trace = _trace(task, _history(task, self.tasks.taskset, state["episode"]))
            fired = [fn.__name__ for fn in stops if _call_hook(fn, task, trace)]
            if fired:
                return EnvReply([], True, {**reply.info, "stopped": 1})
        return reply


def _call_hook(fn: Callable[..., Any], task, trace) -> bool:
    from verifiers.v1.utils.decorators import invoke

    result = invoke(fn, {"task": task.data, "trace": trace})
    return bool(asyncio.run(result) if inspect.isawaitable(result) else result)
