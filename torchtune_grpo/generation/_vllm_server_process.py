"""A vLLM server as the trainer sees it: a URL to POST JSON to, and, when the run started it, a process.

:meth:`VLLMServer.start` launches ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs)
with the routes an RL trainer needs switched on (``VLLM_SERVER_DEV_MODE=1`` for the weight-update and
cache routes, ``--enable-scale-out`` for token-in/token-out generation) and waits until it answers;
:meth:`VLLMServer.connect` checks a server someone else started. Either way every failure names what to
fix: the server's log for one that died while starting, the missing flag for one started without it.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

from torchtune_grpo.runtime.waits import WaitReport

__all__ = ["PYTHON_ENV", "VLLMServer", "VLLMServerError"]

# The interpreter that runs a started server's ``-m vllm.entrypoints.openai.api_server ...``: a command, split as
# a shell splits it (a launcher that stands in for ``python``, such as the tests' fork server,
# scripts/fork_stages.py); unset or empty: this process's interpreter. Read from the server's environment.
PYTHON_ENV = "TORCHTUNE_GRPO_VLLM_PYTHON"

_LOG_TAIL_LINES = 40
_PORT_ATTEMPTS = 3
# Seconds of refused connections after which a listed server is taken to be absent, not starting: long
# enough for a server that is restarting to listen again, short enough that a wrong address is said at once.
REFUSED_FOR = 5.0
# Between two /health probes while waiting: a refused or unanswered probe costs nothing, and a run waits at most
# this long after the server is up.
_POLL_SECONDS = 0.1


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started, reached, or refused a request."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before it runs: on Linux, be sent SIGTERM when the process that started it dies.

    A trainer or generation worker that is killed (SIGKILL, OOM) cannot stop its server; without this the
    server would live on, holding its devices, and a restarted worker would start a second one beside it.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _tail(path: Optional[Path]) -> str:
    if path is None or not path.is_file():
        return ""
    lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    return "\n".join(lines)


class VLLMServer:
    """One vLLM server: ``post`` JSON to it; ``stop`` it if this process started it.

    Args:
        url (str): ``http://host:port``.
        process (Optional[subprocess.Popen]): the server process, when this run started it.
        log_path (Optional[Path]): where that process writes (quoted in errors).
    """

    def __init__(self, url: str, process: Optional[subprocess.Popen] = None, log_path: Optional[Path] = None):
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path

    # ------------------------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, args: List[str], *, log_path: Path, env: Optional[Dict[str, str]] = None,
              timeout: float = 600.0) -> "VLLMServer":
        """Launch a server on a free local port and wait until it answers ``/health``.

        Args:
            args (List[str]): ``vllm serve`` arguments after the model (``--model`` first).
            log_path (Path): the server's stdout and stderr.
            env (Optional[Dict[str, str]]): variables added to this process's environment (e.g.
                ``CUDA_VISIBLE_DEVICES``). Default is None. Its :data:`PYTHON_ENV` (``TORCHTUNE_GRPO_VLLM_PYTHON``,
                else this process's) names the interpreter command; default ``sys.executable``.
            timeout (float): seconds to wait for it to answer. Default is 600.

        Raises:
            VLLMServerError: it exited or did not answer in time (with the end of its log).
        """
        log_path.parent.mkdir(parents=True, exist_ok=True)
        full_env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        # The parent-death signal fires when the *thread* that started the server ends: only the main
        # thread lives as long as the process.
        on_main = threading.current_thread() is threading.main_thread()
        python = shlex.split(full_env.get(PYTHON_ENV, "")) or [sys.executable]
        for attempt in range(_PORT_ATTEMPTS):
            # The port is free when picked but not reserved: another process may take it before the server
            # binds it. Then the server exits saying so, and another port is tried.
            port = _free_port()
            command = [*python, "-m", "vllm.entrypoints.openai.api_server", *args,
                       "--host", "127.0.0.1", "--port", str(port)]
            logged = log_path.stat().st_size if log_path.exists() else 0
            with open(log_path, "ab") as log:
                # Its own session: stop() signals the server and the engine processes it spawned together.
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                           start_new_session=True, preexec_fn=_die_with_parent if on_main else None)
            server = cls(f"http://127.0.0.1:{port}", process, log_path)
            try:
                server.wait_healthy(timeout)
                return server
            except VLLMServerError:
                server.stop()
                with open(log_path, "rb") as log:
                    log.seek(logged)
                    port_taken = b"address already in use" in log.read().lower()
                if not port_taken or attempt == _PORT_ATTEMPTS - 1:
                    raise
            except BaseException:
                server.stop()
                raise
        raise AssertionError("unreachable")

    @classmethod
    def connect(cls, address: str, *, timeout: float = 60.0, refused_for: float = REFUSED_FOR) -> "VLLMServer":
        """A server started elsewhere (``host:port`` or a URL), once it answers ``/health``.

        Args:
            address (str): ``host:port`` or ``http://host:port``.
            timeout (float): seconds a server that accepts connections may take to answer. Default is 60.
            refused_for (float): seconds of refused connections after which nothing is taken to listen there
                (a server restarting is back within a few seconds). Default is :data:`REFUSED_FOR`.

        Raises:
            VLLMServerError: nothing listens at ``address`` (refused for ``refused_for`` seconds), or
                nothing answers within ``timeout`` seconds.
        """
        url = address if "://" in address else f"http://{address}"
        server = cls(url)
        server.wait_healthy(timeout, refused_for=refused_for)
        return server

    def wait_healthy(self, timeout: float, *, refused_for: Optional[float] = None) -> None:
        """Wait until ``/health`` answers 200, logging the wait every half minute.

        Args:
            timeout (float): seconds to wait at most.
            refused_for (Optional[float]): stop early once every attempt for this many seconds was refused
                (a listed server: nothing listens there); None waits ``timeout`` whatever happens (a server
                this run started, which refuses connections until it listens). Default is None.

        Raises:
            VLLMServerError: the started server exited, connections were refused for ``refused_for``
                seconds, or nothing answered within ``timeout``.
        """
        what = f"the vLLM server at {self.url} to answer /health"
        if self.process is not None:
            what = f"the vLLM server this run started (pid {self.process.pid}, log {self.log_path}) to answer /health"
        report = WaitReport(what, limit=timeout, limit_key="generation.startup_timeout")
        refused_since: Optional[float] = None
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise VLLMServerError(
                    f"the vLLM server exited while starting (code {self.process.returncode}); the end of its "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
                refused_since = None
            except (urllib.error.URLError, OSError) as error:
                reason = getattr(error, "reason", error)
                if isinstance(reason, ConnectionRefusedError):
                    refused_since = report.waited if refused_since is None else refused_since
                    if refused_for is not None and report.waited - refused_since >= refused_for:
                        raise VLLMServerError(
                            f"nothing listens at {self.url}: connections refused for {refused_for:g} s. Start "
                            "the server there first (docs/vllm.md, 'vLLM as a server'), or correct the address"
                        ) from None
                else:
                    refused_since = None
            if report.waited > timeout:
                where = f"; the end of its log {self.log_path}:\n{_tail(self.log_path)}" if self.log_path else ""
                raise VLLMServerError(f"no vLLM server answered at {self.url} within {timeout:g} s{where}")
            report()
            time.sleep(_POLL_SECONDS)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server if this run started it (SIGTERM, then SIGKILL); a no-op otherwise."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass

    # -------------------------------------------------------------------------------------- requests

    def post(self, path: str, body: Optional[Dict[str, Any]] = None, *, timeout: float = 600.0) -> Any:
        """POST ``body`` as JSON to ``path``; the decoded JSON answer.

        Raises:
            VLLMServerError: an HTTP error (with the server's message; a 404 on a route this recipe needs
                names the flag that enables it) or no connection.
        """
        data = json.dumps(body if body is not None else {}).encode()
        return self._request(urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                                    headers={"Content-Type": "application/json"}), path, timeout)

    def get(self, path: str, *, timeout: float = 600.0) -> Any:
        """GET ``path``; the decoded JSON answer (errors as :meth:`post`)."""
        return self._request(urllib.request.Request(f"{self.url}{path}", method="GET"), path, timeout)

    def _request(self, request: urllib.request.Request, path: str, timeout: float) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as e:
            message = e.read().decode(errors="replace")[:2000]
            hint = _missing_route_hint(path) if e.code in (403, 404) else ""
            raise VLLMServerError(f"vLLM server {self.url}{path}: HTTP {e.code}: {message}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            died = ""
            if self.process is not None and self.process.poll() is not None:
                died = f" (the server exited with code {self.process.returncode}; its log:\n{_tail(self.log_path)})"
            raise VLLMServerError(f"vLLM server {self.url}{path}: {e}{died}") from None
        return json.loads(text) if text else None


def _missing_route_hint(path: str) -> str:
    if path.startswith("/inference/"):
        return " (start the server with --enable-scale-out: token-in/token-out generation)"
    return " (start the server with VLLM_SERVER_DEV_MODE=1: the weight-update and cache routes)"
