"""OpenEnv servers as multi-turn environments and prompt datasets (docs/environments.md).

OpenEnv (``pip install "torchtune-grpo[openenv]"``) serves an environment over HTTP/WebSocket: each WebSocket
session is one episode with ``reset(seed)`` -> observation and ``step(action)`` -> observation, reward, done.
Here, through OpenEnv's own client (``openenv.core.GenericEnvClient``, observations as plain dicts):

- :func:`openenv_dataset`: one prompt per seed, the text of the observation ``reset(seed)`` returns, so every
  episode of a GRPO group starts from the same state (the environment's reset must be reproducible from its
  seed, which :class:`OpenEnvEnvironment` checks).
- :class:`OpenEnvEnvironment`: the multi-turn ``_component_``. ``start`` opens a session and resets it with the
  row's seed; each ``step`` sends the model's turn as the action ``{action_key: text}`` and appends the
  observation's text as a user message; the rewards the server returns are summed into the episode's
  ``env_reward`` (scored by :class:`~torchtune_grpo.envs.EpisodeInfoReward`); ``done`` ends the episode.
- Either names the server by ``base_url`` or by ``app`` (``module:attribute`` of an OpenEnv app, such as the
  bundled :mod:`torchtune_grpo.envs.openenv_arithmetic`): then each process starts one uvicorn server for it on a
  free local port, shared by every component that names the same app, starts it again when a new episode finds
  it dead, and stops it at exit.

Failures never end the run: a time-out, a server that closed the session or died, a server error or an
observation without the expected text raises inside the environment call, which the rollout turns into an
ended episode with the reward fallback, counted in ``reward/environment/errors`` (and logged here).
"""

import asyncio
import atexit
import itertools
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Dict, List, Optional

from torchtune_grpo.data import PromptDataset
from torchtune_grpo.envs._extras import require
from torchtune_grpo.multiturn import EnvReply
from torchtune_grpo.runtime.waits import WaitReport

__all__ = ["OpenEnvEnvironment", "OpenEnvTimeout", "local_server", "openenv_dataset"]

log = logging.getLogger(__name__)


class OpenEnvTimeout(RuntimeError):
    """The server did not answer a reset or step in time.

    Not a ``TimeoutError``: the rollout reads those as its own ``env_timeout`` and would report that limit.
    """


class _Loop:
    """One event loop in a daemon thread that owns every OpenEnv session of this process.

    The rollout calls environments from fresh event loops (``asyncio.run`` per round) or from threads; a
    WebSocket belongs to the loop that opened it, so all sessions live on this one loop and calls hop onto it.
    """

    _instance: Optional["_Loop"] = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="openenv-sessions", daemon=True).start()

    @classmethod
    def get(cls) -> "_Loop":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def run(self, coro, timeout: Optional[float], what: str) -> Any:
        """Runs ``coro`` on the loop and waits at most ``timeout`` seconds (then cancels it and raises)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:  # concurrent.futures.TimeoutError is TimeoutError from Python 3.11
            future.cancel()
            raise OpenEnvTimeout(f"OpenEnv {what}: no answer within {timeout} s") from None


# ---- local servers: one uvicorn process per app and process, stopped at exit

_servers: Dict[str, "subprocess.Popen[bytes]"] = {}
_urls: Dict[str, str] = {}
_servers_lock = threading.Lock()


# The server process: uvicorn, plus a watcher that ends it once its parent is gone. atexit alone is not enough:
# the recipe's worker processes end with os._exit (docs/distributed.md), which runs no exit handler, and a
# parent killed by a signal runs none either.
_SERVE = """
import os, sys, threading, time
import uvicorn

parent = os.getppid()

def watch():
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)

threading.Thread(target=watch, daemon=True).start()
uvicorn.run(sys.argv[1], host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_servers() -> None:
    for proc in _servers.values():
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


atexit.register(_stop_servers)


def local_server(app: str, startup_timeout: float = 60.0) -> str:
    """The URL of this process's server for ``app``, started on first use (uvicorn on a free local port).

    The server ends with this process (at exit, or within a second of its death, however it died).

    Args:
        app (str): the OpenEnv app as uvicorn names it, ``module:attribute``
            (``torchtune_grpo.envs.openenv_arithmetic:app``); the module must import in a fresh interpreter
            with this process's ``PYTHONPATH``.
        startup_timeout (float): seconds to wait for ``/health``. Default is 60.

    Returns:
        str: ``http://127.0.0.1:<port>``.

    Raises:
        RuntimeError: when the server exits or is not healthy in time (with the end of its log).
    """
    with _servers_lock:
        proc = _servers.get(app)
        if proc is not None and proc.poll() is None:
            return _urls[app]
        port = _free_port()
        logfile = tempfile.NamedTemporaryFile(prefix="openenv-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-c", _SERVE, app, str(port)]
        proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        url = f"http://127.0.0.1:{port}"
        report = WaitReport(f"the OpenEnv server for app {app!r} (pid {proc.pid}, log {logfile.name}) to answer "
                            "/health", limit=startup_timeout)
        while True:
            if proc.poll() is not None or report.waited > startup_timeout:
                proc.kill()
                with open(logfile.name, errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"the OpenEnv server for app {app!r} (uvicorn on port {port}) did not start:\n{tail}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                report()
                time.sleep(0.2)
        log.info(f"OpenEnv server for {app} at {url} (pid {proc.pid}, log {logfile.name})")
        _servers[app], _urls[app] = proc, url
        return url


def _server_url(base_url: Optional[str], app: Optional[str], where: str) -> str:
    if (base_url is None) == (app is None):
        raise ValueError(f"{where}: set exactly one of base_url (a running OpenEnv server) or app (module:attribute "
                         f"of an OpenEnv app to start here); got base_url={base_url!r}, app={app!r}")
    return base_url if base_url is not None else local_server(app)


def _text(result, key: str, what: str) -> str:
    """The observation's text field, or ValueError naming what was there (a malformed observation)."""
    observation = getattr(result, "observation", None)
    if not isinstance(observation, dict) or not isinstance(observation.get(key), str):
        shown = sorted(observation) if isinstance(observation, dict) else type(observation).__name__
        raise ValueError(f"malformed OpenEnv observation after {what}: expected a text field {key!r}, got {shown}"
                         + (f" ({key}={observation.get(key)!r})" if isinstance(observation, dict) else ""))
    return observation[key]


def _reward(result, what: str) -> float:
    reward = getattr(result, "reward", None)
    if reward is None:
        return 0.0
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        raise ValueError(f"malformed OpenEnv reward after {what}: {reward!r}")
    return float(reward)


class OpenEnvEnvironment:
    """A multi-turn environment served by OpenEnv (see the module docstring).

    Example YAML::

        environment:
          _component_: torchtune_grpo.envs.OpenEnvEnvironment
          app: torchtune_grpo.envs.openenv_arithmetic:app    # or base_url: http://127.0.0.1:8000
        multi_turn: {max_turns: 2, env_timeout: 30}
        reward_functions:
          - {_component_: torchtune_grpo.envs.EpisodeInfoReward, key: env_reward, name: correctness}

    Args:
        base_url (Optional[str]): a running server (``http://host:port`` or ``ws://...``). Default is None.
        app (Optional[str]): instead, an OpenEnv app (``module:attribute``) this process serves itself
            (:func:`local_server`). Default is None.
        action_key (str): the action's field that carries the model's turn text. Default is ``"message"``.
        observation_key (str): the observation's text field, appended as a user message. Default is
            ``"message"``.
        seed_key (Optional[str]): the row column passed to ``reset`` as ``seed`` (None: reset without one).
            Default is ``"seed"``.
        check_reset (bool): when the row has an ``observation`` column (:func:`openenv_dataset`), a reset that
            gives another text fails the episode (the prompt would not be the episode's start). Default is True.
        connect_timeout (float): seconds to open a session. Default is 10.
        message_timeout (float): seconds to wait for one reset or step answer. Default is 20.

    Raises:
        ValueError: unless exactly one of ``base_url`` and ``app`` is set.
        MissingExtraError: when openenv-core is not installed (the message names the extra).
    """

    def __init__(
        self, base_url: Optional[str] = None, app: Optional[str] = None, action_key: str = "message",
        observation_key: str = "message", seed_key: Optional[str] = "seed", check_reset: bool = True,
        connect_timeout: float = 10.0, message_timeout: float = 20.0,
    ) -> None:
        self._client_cls = require("openenv", "torchtune_grpo.envs.OpenEnvEnvironment").GenericEnvClient
        self.base_url = _server_url(base_url, app, "environment")
        self.app = app
        self.action_key, self.observation_key, self.seed_key = action_key, observation_key, seed_key
        self.check_reset = check_reset
        self.connect_timeout, self.message_timeout = float(connect_timeout), float(message_timeout)
        self.failures = 0
        self._loop = _Loop.get()
        self._sessions: Dict[int, Any] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stepped = False  # a step since the last start: the next start begins a new rollout

    def _fail(self, session: int, error: BaseException, what: str) -> None:
        with self._lock:
            self.failures += 1
            count = self.failures
        log.warning(f"OpenEnv episode ended by a failure in {what} ({count} so far; reward fallback): "
                    f"{type(error).__name__}: {error}")
        self._close(session)

    def _close(self, session: int) -> None:
        with self._lock:
            client = self._sessions.pop(session, None)
        if client is not None:
            asyncio.run_coroutine_threadsafe(_quiet_close(client), self._loop.loop)

    def _close_leftovers(self) -> None:
        # Episodes that ran out of turns or tokens are never told they ended: their sessions close when the
        # next rollout starts, so a long run holds at most one rollout's sessions on the server.
        with self._lock:
            if not self._stepped:
                return
            self._stepped = False
            left = list(self._sessions)
        for session in left:
            self._close(session)

    def start(self, fields: Dict[str, Any]) -> int:
        """Opens a session and resets it with the row's seed; returns the session's key (the episode state)."""
        self._close_leftovers()
        session = next(self._ids)
        try:
            if self.app is not None:  # a server this process runs: started again if it died
                self.base_url = local_server(self.app)
            client = self._client_cls(base_url=self.base_url, connect_timeout_s=self.connect_timeout,
                                      message_timeout_s=self.message_timeout)
            with self._lock:
                self._sessions[session] = client
            kwargs = {} if self.seed_key is None or fields.get(self.seed_key) is None else {"seed": int(fields[self.seed_key])}
            result = self._loop.run(_connect_and_reset(client, kwargs), self.connect_timeout + self.message_timeout, "reset")
            text = _text(result, self.observation_key, "reset")
            if self.check_reset and isinstance(fields.get("observation"), str) and text != fields["observation"]:
                raise ValueError(f"reset({kwargs}) gave {text[:80]!r}, not the prompt's observation "
                                 f"{fields['observation'][:80]!r}: the server's reset is not reproducible from its seed")
        except Exception as e:
            self._fail(session, e, "reset")
            raise
        return session

    def step(self, session: int, message: Dict[str, Any]) -> EnvReply:
        """Sends the model's turn as the action; the observation's text comes back as a user message."""
        with self._lock:
            self._stepped = True
            client = self._sessions.get(session)
        try:
            if client is None:
                raise RuntimeError(f"OpenEnv session {session} is closed")
            result = self._loop.run(client.step({self.action_key: message["content"]}), self.message_timeout, "step")
            text = _text(result, self.observation_key, "step")
            info = {"env_reward": _reward(result, "step"), "env_steps": 1}
        except Exception as e:
            self._fail(session, e, "step")
            raise
        if bool(getattr(result, "done", False)):
            self._close(session)
            return EnvReply([], True, info)
        return EnvReply([{"role": "user", "content": text}], False, info)


async def _connect_and_reset(client, kwargs: Dict[str, Any]):
    await client.connect()
    return await client.reset(**kwargs)


async def _quiet_close(client) -> None:
    try:
        await client.close()
    except Exception:  # noqa: BLE001 - a dead server's session is gone anyway
        pass


def openenv_dataset(
    tokenizer,
    num_episodes: int = 256,
    seed: int = 0,
    base_url: Optional[str] = None,
    app: Optional[str] = None,
    observation_key: str = "message",
    max_prompt_length: Optional[int] = 256,
    prompt_style: str = "chat",
    system_prompt: Optional[str] = None,
    message_timeout: float = 20.0,
) -> PromptDataset:
    """One prompt per seed ``seed, seed + 1, ...``: the text of the observation the server's ``reset(seed)`` gives.

    Args:
        tokenizer: a torchtune model tokenizer.
        num_episodes (int): prompts (seeds). Default is 256.
        seed (int): the first seed. Use another range for a validation dataset. Default is 0.
        base_url (Optional[str]): a running server. Default is None.
        app (Optional[str]): instead, an OpenEnv app this process serves (the same server as an
            :class:`OpenEnvEnvironment` naming the same app). Default is None.
        observation_key (str): the observation's text field. Default is ``"message"``.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 256.
        prompt_style (str): ``"chat"`` or ``"r1"``. Default is ``"chat"``.
        system_prompt (Optional[str]): instruction text. Default is None (the style's own).
        message_timeout (float): seconds per reset. Default is 20.

    Returns:
        PromptDataset: rows ``{tokens, prompt, answer: "", question, observation, seed}``.

    Raises:
        ValueError: for a bad size or server choice, or a reset without the text field (naming the seed).
        MissingExtraError: when openenv-core is not installed.
    """
    if int(num_episodes) < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    client_cls = require("openenv", "torchtune_grpo.envs.openenv_dataset").GenericEnvClient
    url = _server_url(base_url, app, "dataset")
    seeds = list(range(int(seed), int(seed) + int(num_episodes)))
    loop = _Loop.get()

    async def reset_all(client) -> List[Any]:
        await client.connect()
        try:
            return [await client.reset(seed=s) for s in seeds]  # one session, reset again for every seed
        finally:
            await client.close()

    results = loop.run(reset_all(client_cls(base_url=url, message_timeout_s=message_timeout)),
                       message_timeout * len(seeds) + 10, f"reset of {len(seeds)} seeds")
    rows = []
    for s, result in zip(seeds, results):
        text = _text(result, observation_key, f"reset(seed={s}) at {url}")
        rows.append({"question": text, "observation": text, "answer": "", "seed": s})
    return PromptDataset(rows, tokenizer, formatter=prompt_style, max_prompt_length=max_prompt_length,
                         system_prompt=system_prompt, source_name=f"OpenEnv server {url}", required_columns=("question",))
