"""``tune run`` from a process that has already imported torch, torchtune and the recipes.

Each ``tune run`` of a test pays interpreter start-ups before its first step: the ``tune`` command's and, on N
processes, each rank's (importing torch, torchtune, torchao and the recipe: ~6 s each on 2 cores, shared
with the suite's other worker). Here one server per pytest process (scripts/fork_stages.py) imports them once,
and the ``tune`` command is a child forked from it; so are its ranks: torchrun starts them with ``PYTHON_EXEC``
(its documented override of the interpreter), which is a shim that asks the same server. Everything after the
start-up is the real thing: the ``tune`` CLI, torchrun's launcher and elastic agent, the recipe run as
``__main__``, exit codes and signals (scripts/fork_stages.py). The demo scripts' tests put forked ``tune`` and
``tune-grpo`` commands first on the script's ``PATH`` (:func:`forked_commands_path`), and the one-launch runs
(tests/_spawn_runs.py) fork their two processes here too. A few tests keep fresh interpreters end to end
(tests/test_recipe.py, tests/test_distributed_runs.py: ``run_tune(..., forked=False)`` or ``tune_command``).
"""

import atexit
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from tests.conftest import REPO

FORK_STAGES = REPO / "scripts" / "fork_stages.py"
# What every launched process imports before its first step (measured with `python -X importtime`): the CLI,
# the launcher, both recipes (with torch, torchtune, torchao and the package's training modules), the tests'
# reward components. Not transformers or vLLM: the runs that need them import them as before. None of them
# imports a package of the optional extras' folders (tests/extras.py), which a run puts first on its PYTHONPATH
# (a forked command keeps what the server imported, and finds the rest on its own PYTHONPATH).
MODULES = [
    "torch", "torchtune", "torchtune._cli.tune", "torch.distributed.run", "grpo_full_finetune_distributed",
    "grpo_lora_finetune_distributed", "tests._rewards",
]

_server: Optional[subprocess.Popen] = None
_dir: Optional[Path] = None


def _stop() -> None:
    if _server is not None and _server.poll() is None:
        _server.terminate()
        _server.wait(timeout=30)
    if _dir is not None:
        shutil.rmtree(_dir, ignore_errors=True)


def _start(server_env: Dict[str, str]) -> Path:
    """The directory of this process's fork server (its socket ``s.sock`` and the rank shim ``python``), started
    at the first call in ``server_env`` (or again if it died)."""
    global _server, _dir
    if _server is None or _server.poll() is not None:
        if _server is None:
            atexit.register(_stop)
        else:  # it died (it should not): a new one, in a new directory
            _stop()
        _dir = Path(tempfile.mkdtemp(prefix="tune-fork-"))
        sock = _dir / "s.sock"
        # Started from the repository root (sys.path of a script run from elsewhere is the same: PYTHONPATH).
        _server = subprocess.Popen([sys.executable, str(FORK_STAGES), "serve", str(sock), *MODULES], cwd=REPO,
                                   env=server_env, stdin=subprocess.DEVNULL)
        _shim(_dir / "python", f'"{sys.executable}" "{FORK_STAGES}" run "{sock}"')
    return _dir


def _shim(path: Path, command: str) -> None:
    path.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def forked(command: List[str], env: Dict[str, str], server_env: Dict[str, str]) -> List[str]:
    """``command`` (``[TUNE, "run", ...]``) as a child of this process's fork server, and ``env`` (the
    command's) updated in place so that torchrun's ranks are forked children too. The server starts at the
    first call, in ``server_env`` (the tests' plain ``tune run`` environment, tests/recipe_utils.py
    ``tune_env()``: what the imports see; each command then runs in its own ``env``)."""
    directory = _start(server_env)
    env["PYTHON_EXEC"] = str(directory / "python")
    return [sys.executable, str(FORK_STAGES), "run", str(directory / "s.sock"), *command]


def forked_commands_path(server_env: Dict[str, str]) -> str:
    """A folder to put first on ``PATH`` of a script (the demo scripts) whose ``tune`` and ``tune-grpo`` are
    children of this process's fork server (its ``tune run``s and ``tune-grpo eval``s start without importing
    torch, torchtune and the recipes again: ~4 s each on 2 busy cores), and whose ``python`` is this
    interpreter, started as usual (the scripts' ``python - <<PY`` and ``python -c`` stay fresh processes).
    ``server_env`` as for :func:`forked`."""
    directory = _start(server_env)
    bin_dir = directory / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        scripts = Path(sys.executable).parent
        for name in ("tune", "tune-grpo"):  # the console scripts, run as the forked child's __main__
            _shim(bin_dir / name, f'"{sys.executable}" "{FORK_STAGES}" run "{directory / "s.sock"}" "{scripts / name}"')
        _shim(bin_dir / "python", f'"{sys.executable}"')
    return str(bin_dir)
