"""Running model-written Python against test cases in a separate, limited, throwaway process.

Each call of :func:`run_python_tests` starts one fresh interpreter (``python -I -S``: no user site, no
environment variables, no site-packages unless asked) in a new session, with:

- **wall-clock limit** (hard): after ``time_limit`` seconds the whole process group is killed with
  SIGKILL by the parent. With the PID namespace (below) every process the code started dies with it.
- **CPU limit** (hard): ``RLIMIT_CPU`` of ``ceil(time_limit) + 1`` seconds, enforced by the kernel.
- **memory limit** (hard): ``RLIMIT_AS`` (address space) of ``memory_limit_mb``, enforced by the kernel:
  an allocation past it fails with ``MemoryError`` in the child (that test fails, the others still run).
  ``RLIMIT_FSIZE`` caps any file it writes (``max_file_mb``), ``RLIMIT_CORE`` is 0.
- **throwaway directory**: the working directory, ``HOME`` and ``TMPDIR`` are a fresh
  :class:`tempfile.TemporaryDirectory`, deleted afterwards; the environment holds only ``PATH``,
  ``HOME``, ``TMPDIR`` and ``LANG``.
- **no network**, two layers:

  1. *network namespace* (``network="namespace"``, or ``"auto"`` where it works): the interpreter runs under
     ``unshare --user --map-root-user --net --pid --fork --kill-child``. The kernel gives it a network
     namespace with only a loopback interface, which is down, and its own PID namespace. This holds
     whatever the code does (ctypes, C extensions, subprocesses). It needs unprivileged user namespaces
     (most Linux hosts; some container runtimes forbid them: ``"auto"`` then falls back to layer 2 and
     logs a warning once).
  2. *audit hook* (always on unless ``block_sockets=False``): before the code runs, a
     :func:`sys.addaudithook` hook makes every ``socket.*`` event (creating, connecting, binding,
     resolving) raise ``PermissionError``. The same hook blocks starting processes (``os.system``,
     ``subprocess``, ``os.fork``, ``os.exec*``, ``os.posix_spawn``), signalling other processes, loading
     native code through ``ctypes``, and (``restrict_writes``) opening for writing, creating, deleting,
     renaming or changing any path outside the throwaway directory.

What this is not: a security boundary against code written to escape. Audit hooks run in the same
interpreter as the code and can be defeated by a determined adversary (the Python docs say so); the
process runs as the trainer's user, can read every file that user can, and can use CPU and memory up to
the limits. Only the kernel-enforced parts (namespaces, rlimits, the kill) hold against such code. For
untrusted code at scale run the trainer itself in a container or VM without credentials, as a non-root
user. The audit layer's job is to turn the accidents a policy makes (loops, runaway allocation, network
calls, stray writes, forks) into failed tests instead of a damaged run.
"""

import functools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from torchtune_grpo.rewards._sandbox_runner import RUNNER
from torchtune_grpo.rewards.code_tests import normalize_tests

__all__ = [
    "NETWORK_MODES",
    "SandboxResult",
    "network_namespace_available",
    "normalize_tests",
    "ProgramResult",
    "run_python_program",
    "run_python_tests",
]

log = logging.getLogger(__name__)

#: Valid ``network`` values of :func:`run_python_tests`.
NETWORK_MODES = ("auto", "namespace", "audit")

_UNSHARE_ARGS = ("--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child")


class SandboxResult(NamedTuple):
    """What one sandboxed run produced.

    Attributes:
        passed (int): tests passed.
        total (int): tests run (all of them, including those never reached).
        status (str): ``"ok"`` (the runner finished), ``"timeout"`` (killed at the wall-clock limit) or
            ``"crashed"`` (the interpreter died: CPU limit, a segfault, ``os._exit``...).
        results (List[bool]): pass/fail per test (tests never reached count as failed).
        reasons (List[str]): why each failed test failed (``""`` when passed or never reached).
        seconds (float): wall-clock seconds of the run.
    """

    passed: int
    total: int
    status: str
    results: List[bool]
    reasons: List[str]
    seconds: float

    @property
    def fraction(self) -> float:
        """Fraction of tests passed, in ``[0, 1]``."""
        return self.passed / self.total if self.total else 0.0


@functools.lru_cache(maxsize=None)
def network_namespace_available(python: Optional[str] = None) -> bool:
    """Whether ``unshare`` can put an unprivileged process in new user, network and PID namespaces here.

    Runs ``unshare ... python -c`` once per interpreter path and caches the answer.

    Args:
        python (Optional[str]): the interpreter to try. Default is None (``sys.executable``).

    Returns:
        bool: True when the namespace layer works.
    """
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run(
            [unshare, *_UNSHARE_ARGS, python or sys.executable, "-I", "-S", "-c", "print('ok')"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    # unshare exits non-zero ("unshare failed: Operation not permitted") when it cannot create them.
    return proc.returncode == 0 and proc.stdout.strip() == b"ok"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_python_tests(
    code: str,
    tests: Any,
    time_limit: float = 10.0,
    test_time_limit: Optional[float] = None,
    memory_limit_mb: Optional[int] = 1024,
    max_file_mb: int = 16,
    network: str = "auto",
    block_sockets: bool = True,
    block_processes: bool = True,
    restrict_writes: bool = True,
    site_packages: bool = False,
    python: Optional[str] = None,
) -> SandboxResult:
    """Runs ``code`` against ``tests`` in a fresh sandboxed interpreter (see the module docstring).

    Args:
        code (str): the Python source of the solution.
        tests (Any): test cases, any shape :func:`normalize_tests` accepts.
        time_limit (float): hard wall-clock seconds for the whole run (interpreter start and every test).
            Default is 10.0.
        test_time_limit (Optional[float]): soft per-test seconds (``SIGALRM`` in the child), so one slow
            test fails without using the whole budget. Default is None (only the hard limit).
        memory_limit_mb (Optional[int]): address-space limit in MiB. Default is 1024. None: no limit.
        max_file_mb (int): largest file the code may write, MiB. Default is 16.
        network (str): ``"auto"``, ``"namespace"`` or ``"audit"`` (see the module docstring).
            Default is ``"auto"``.
        block_sockets (bool): audit hook against socket use. Default is True.
        block_processes (bool): audit hook against starting processes. Default is True.
        restrict_writes (bool): audit hook against writes outside the throwaway directory. Default is True.
        site_packages (bool): let the code import installed packages (drops ``-S``). Default is False.
        python (Optional[str]): the interpreter. Default is None (``sys.executable``).

    Returns:
        SandboxResult: tests passed, per-test results and how the run ended.

    Raises:
        ValueError: on bad tests or settings.
        RuntimeError: if ``network="namespace"`` and namespaces are unavailable.
    """
    cases = normalize_tests(tests)
    results, reasons, status, seconds = _run_sandboxed(
        code, cases, time_limit=time_limit, test_time_limit=test_time_limit, memory_limit_mb=memory_limit_mb,
        max_file_mb=max_file_mb, network=network, block_sockets=block_sockets, block_processes=block_processes,
        restrict_writes=restrict_writes, site_packages=site_packages, python=python,
    )
    return SandboxResult(sum(results), len(cases), status, results, reasons, seconds)


def _run_sandboxed(
    code: str,
    cases: List[Dict[str, Any]],
    *,
    time_limit: float,
    test_time_limit: Optional[float],
    memory_limit_mb: Optional[int],
    max_file_mb: int,
    network: str,
    block_sockets: bool,
    block_processes: bool,
    restrict_writes: bool,
    site_packages: bool,
    python: Optional[str],
) -> Tuple[List[bool], List[str], str, float]:
    """One sandboxed interpreter over normalised ``cases``: per-case results and reasons, status, seconds."""
    if network not in NETWORK_MODES:
        raise ValueError(f"network must be one of {list(NETWORK_MODES)}, got {network!r}")
    if not (time_limit > 0 and math.isfinite(time_limit)):
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit}")
    python = python or sys.executable
    use_namespace = False
    if network != "audit":
        use_namespace = network_namespace_available(python)
        if not use_namespace:
            if network == "namespace":
                raise RuntimeError(
                    "network='namespace' needs `unshare` with unprivileged user namespaces, which this host "
                    "does not allow; use network='audit' (sockets blocked by an audit hook only)"
                )
            _warn_no_namespace()

    nonce = secrets.token_hex(16)
    cmd = [python, "-I"] + ([] if site_packages else ["-S"]) + ["-c", RUNNER]
    if use_namespace:
        cmd = [shutil.which("unshare") or "unshare", *_UNSHARE_ARGS] + cmd
    with tempfile.TemporaryDirectory(prefix="grpo_sandbox_", ignore_cleanup_errors=True) as root:
        workdir = os.path.join(root, "work")
        os.mkdir(workdir, 0o700)
        results_path = os.path.join(root, "results.txt")
        job = {
            "code": code,
            "tests": cases,
            "nonce": nonce,
            "workdir": workdir,
            "results_path": results_path,
            "memory_bytes": None if memory_limit_mb is None else int(memory_limit_mb) * 1024 * 1024,
            "cpu_seconds": int(math.ceil(time_limit)) + 1,
            "fsize_bytes": int(max_file_mb) * 1024 * 1024,
            "test_time_limit": test_time_limit,
            "block_sockets": block_sockets,
            "block_processes": block_processes,
            "restrict_writes": restrict_writes,
        }
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so the kill below reaches its children
            close_fds=True,
        )
        status = "ok"
        try:
            proc.communicate(json.dumps(job).encode("utf-8"), timeout=time_limit)
        except subprocess.TimeoutExpired:
            status = "timeout"
        finally:
            _kill_group(proc)  # also reaps stragglers after a normal exit
            proc.wait()
        seconds = time.monotonic() - start
        if status == "ok" and proc.returncode != 0:
            status = "crashed"
        results = [False] * len(cases)
        reasons = [""] * len(cases)
        try:
            with open(results_path, encoding="utf-8", errors="replace") as f:
                lines = f.read(1024 * 1024).splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            parts = line.split(" ", 3)
            if len(parts) < 3 or parts[0] != nonce:
                continue
            try:
                i, ok = int(parts[1]), parts[2] == "1"
            except ValueError:
                continue
            if 0 <= i < len(cases):
                results[i] = ok
                # a program run reports its output (JSON) whether or not it failed
                reasons[i] = parts[3] if len(parts) > 3 and (parts[3] or not ok) else ("" if ok else "failed")
    return results, reasons, status, seconds


class ProgramResult(NamedTuple):
    """What :func:`run_python_program` saw.

    Attributes:
        stdout (str): what the program printed (the first ``max_output_chars`` characters).
        error (str): ``""``, the uncaught exception (``"NameError: ..."``), or why it was stopped
            (``"timeout: ..."``, ``"crashed: ..."``).
        cut (bool): the output was longer than ``max_output_chars``.
        seconds (float): wall-clock seconds of the run.
    """

    stdout: str
    error: str
    cut: bool
    seconds: float


def run_python_program(
    code: str,
    time_limit: float = 5.0,
    memory_limit_mb: Optional[int] = 512,
    max_output_chars: int = 4000,
    network: str = "auto",
    python: Optional[str] = None,
) -> ProgramResult:
    """Runs ``code`` as ``__main__`` in a fresh sandboxed interpreter (the limits of :func:`run_python_tests`:
    wall-clock, CPU, memory, throwaway directory, no network, no processes) and returns what it printed.

    Args:
        code (str): the program.
        time_limit (float): hard wall-clock seconds. Default is 5.0.
        memory_limit_mb (Optional[int]): address-space limit in MiB. Default is 512.
        max_output_chars (int): stdout kept. Default is 4000.
        network (str): see :func:`run_python_tests`. Default is ``"auto"``.
        python (Optional[str]): the interpreter. Default is None (``sys.executable``).

    Returns:
        ProgramResult: the output and how the run ended.
    """
    results, reasons, status, seconds = _run_sandboxed(
        code, [{"kind": "program", "max_output": int(max_output_chars)}], time_limit=time_limit,
        test_time_limit=None, memory_limit_mb=memory_limit_mb, max_file_mb=16, network=network,
        block_sockets=True, block_processes=True, restrict_writes=True, site_packages=False, python=python,
    )
    try:
        payload = json.loads(reasons[0])
    except (json.JSONDecodeError, TypeError):
        payload = None
    if status != "ok" or not isinstance(payload, dict):
        why = {"timeout": f"timeout: stopped after {time_limit} s", "ok": "crashed: no result"}.get(
            status, "crashed: the interpreter died (CPU or memory limit, or os._exit)")
        return ProgramResult("", why, False, seconds)
    return ProgramResult(str(payload["stdout"]), str(payload["error"]), bool(payload["cut"]), seconds)


@functools.lru_cache(maxsize=None)
def _warn_no_namespace() -> None:
    log.warning(
        "sandbox: unprivileged network namespaces are not available here (no `unshare`, or user namespaces "
        "are disabled); model code is kept off the network by an in-process audit hook only"
    )
