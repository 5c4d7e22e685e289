"""Custom rewards written as plain Python functions, loaded from a dotted path or a ``.py`` file.

The signature (sync or ``async def``)::

    def my_reward(completions: List[str], **columns) -> List[float]: ...

``columns`` are ``prompts`` (List[str]), ``completion_ids`` (List[List[int]]) and every dataset column as
a list aligned with ``completions`` (``answer``, ``tests``, ...). A function receives only the keyword
arguments it declares, unless it takes ``**kwargs``, which gets them all. Return one float per completion;
an exception instance in place of a float fails that one sample (see :class:`~torchtune_grpo.rewards.Reward`).
"""

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional

from torchtune_grpo.rewards._base import Reward, RewardBatch, to_plain
from torchtune_grpo.rewards._execution import resolve_awaitable

__all__ = ["PythonReward", "load_function", "python_reward"]

_FILE_LOCK = threading.Lock()
_FILE_MODULES: Dict[str, Any] = {}


def _load_file(path: str) -> Any:
    real = os.path.realpath(os.path.expanduser(path))
    if not os.path.isfile(real):
        raise ValueError(f"reward file not found: {path!r} (resolved to {real!r}, cwd {os.getcwd()!r})")
    with _FILE_LOCK:
        if real in _FILE_MODULES:
            return _FILE_MODULES[real]
        stem = os.path.splitext(os.path.basename(real))[0]
        digest = hashlib.sha1(real.encode()).hexdigest()[:10]
        module_name = f"_torchtune_grpo_user_rewards.{stem}_{digest}"
        spec = importlib.util.spec_from_file_location(module_name, real)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {real!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        # Registered before running it, so dataclasses/pickle inside the file can find their module.
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(module_name, None)
            raise
        _FILE_MODULES[real] = module
        return module


def _get_attr_path(obj: Any, path: str, where: str) -> Any:
    for part in path.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{where} has no attribute {part!r} (looking up {path!r})")
        obj = getattr(obj, part)
    return obj


def load_function(spec: str) -> Callable[..., Any]:
    """Resolves a reward function from a string.

    Accepted forms:

    - ``"my_package.my_module.my_fn"``: a dotted path (the longest importable module prefix, then
      attributes), or ``"my_package.my_module:my_fn"``;
    - ``"/path/to/rewards.py:my_fn"`` or ``"rewards.py:my_fn"`` (relative to the working directory): a
      Python file, loaded once per resolved path, then the attribute after the colon.

    Args:
        spec (str): where the function is.

    Returns:
        Callable[..., Any]: the function (or any callable object).

    Raises:
        ValueError: if it cannot be found or is not callable (the message says what was tried).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"function must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    module_part, sep, attr = spec.rpartition(":")
    if sep and (module_part.endswith(".py") or os.sep in module_part or "/" in module_part):
        fn = _get_attr_path(_load_file(module_part), attr, f"file {module_part!r}")
    elif spec.endswith(".py"):
        raise ValueError(f"give the function name after the file: '{spec}:my_reward'")
    elif sep:
        try:
            module = importlib.import_module(module_part)
        except ImportError as e:
            raise ValueError(f"cannot import module {module_part!r} for reward function {spec!r}: {e}") from e
        fn = _get_attr_path(module, attr, f"module {module_part!r}")
    else:
        parts = spec.split(".")
        fn, errors = None, []
        for cut in range(len(parts) - 1, 0, -1):
            module_name = ".".join(parts[:cut])
            try:
                module = importlib.import_module(module_name)
            except ImportError as e:
                errors.append(f"{module_name}: {e}")
                continue
            fn = _get_attr_path(module, ".".join(parts[cut:]), f"module {module_name!r}")
            break
        if fn is None:
            raise ValueError(
                f"cannot import reward function {spec!r}; tried modules: {'; '.join(errors) or 'none'}. "
                "Use 'package.module.function' (importable from the working directory or an installed "
                "package) or '/path/to/file.py:function'."
            )
    if not callable(fn):
        raise ValueError(f"{spec!r} is {type(fn).__name__}, not a callable")
    return fn


def _accepted_kwargs(fn: Callable[..., Any]) -> Optional[set]:
    """The keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (or cannot be inspected)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


class PythonReward(Reward):
    """Wraps a plain function ``fn(completions, **columns) -> List[float]`` (sync or async) as a reward.

    See the module docstring for the columns passed. The reward's name is the function's name.

    Args:
        function (Union[str, Callable]): the function, or where to find it (see :func:`load_function`).
        function_kwargs (Optional[Mapping[str, Any]]): fixed keyword arguments for every call (e.g.
            thresholds from YAML); a dataset column of the same name overrides them. Default is None.
        name (Optional[str]): the reward name. Default is None (the function's ``__name__``).

    Raises:
        ValueError: if the function cannot be found or does not take ``completions`` first.
    """

    def __init__(
        self,
        function: Any,
        function_kwargs: Optional[Mapping[str, Any]] = None,
        name: Optional[str] = None,
    ) -> None:
        fn = load_function(function) if isinstance(function, str) else function
        if not callable(fn):
            raise ValueError(f"function must be callable, got {type(fn).__name__}")
        self.function = fn
        self.function_kwargs = dict(to_plain(function_kwargs) or {})
        self._accepted = _accepted_kwargs(fn)
        if self._accepted is not None:
            params = list(inspect.signature(fn).parameters.values())
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
                raise ValueError(
                    f"reward function {getattr(fn, '__name__', fn)!r} must take the completions as its first "
                    "argument: def my_reward(completions, **columns) -> List[float]"
                )
        base = fn.func if isinstance(fn, functools.partial) else fn
        self.name = name or getattr(base, "__name__", None) or type(base).__name__
        self.is_async = inspect.iscoroutinefunction(base) or inspect.iscoroutinefunction(
            getattr(base, "__call__", None)
        )

    def __call__(self, batch: RewardBatch) -> List[Any]:
        columns: Dict[str, Any] = dict(self.function_kwargs)
        columns.update(batch.columns())
        columns["prompts"] = list(batch.prompts)
        columns["completion_ids"] = list(batch.completion_ids)
        columns.pop("completions", None)
        if self._accepted is not None:
            columns = {k: v for k, v in columns.items() if k in self._accepted}
        return resolve_awaitable(self.function(list(batch.completions), **columns))

    def __repr__(self) -> str:
        return f"PythonReward({self.name})"


def python_reward(
    function: Any,
    function_kwargs: Optional[Mapping[str, Any]] = None,
    name: Optional[str] = None,
) -> PythonReward:
    """YAML entry point for a custom Python reward function (see :class:`PythonReward`).

    Example YAML::

        reward_functions:
          - _component_: torchtune_grpo.rewards.python_reward
            function: my_rewards.brevity            # or /abs/path/rewards.py:brevity
            function_kwargs: {max_words: 200}
            weight: 0.2
            timeout: 2.0                            # per sample; slower samples score the fallback
            fallback: 0.0

    Args:
        function (Union[str, Callable]): the function or its location (see :func:`load_function`).
        function_kwargs (Optional[Mapping[str, Any]]): fixed keyword arguments. Default is None.
        name (Optional[str]): the reward name. Default is None (the function's name).

    Returns:
        PythonReward: the reward.
    """
    return PythonReward(function, function_kwargs=function_kwargs, name=name)
