"""``tune run`` from a process that has already imported torch, torchtune and the recipes.

Each ``tune run`` of a test pays interpreter start-ups before its first step: the ``tune`` command's and, on N
processes, each rank's (importing torch, torchtune, torchao and the recipe: ~6 s each on 2 cores, shared
with the suite's other worker). Here one server per pytest process (scripts/fork_stages.py) imports them once,
and the ``tune`` command is a child forked from it; so are its ranks: torchrun starts them with ``PYTHON_EXEC``
(its documented override of the interpreter), which is a shim that asks the same server. Everything after the
start-up is the real thing: the ``tune`` CLI, torchrun's launcher and elastic agent, the recipe run as
``__main__``, exit codes and signals (scripts/fork_stages.py; a command leaves as the interpreter does, threads
joined and atexit handlers run, but without tearing down the objects it inherited: 0.6-3 s a command). The demo
scripts' tests put forked ``tune`` and ``tune-grpo`` commands first on the script's ``PATH``
(:func:`forked_commands_path`), and the one-launch runs (tests/_spawn_runs.py) fork their two processes here too. tests/test_recipe.py keeps fresh interpreters end to end,
on one process and on two (``run_tune(..., forked=False)``).
"""

import atexit
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from tests.conftest import REPO

FORK_STAGES = REPO / "scripts" / "fork_stages.py"
# What every launched process imports before its first step (measured with `python -X importtime`): the CLI,
# the launcher, both recipes (with torch, torchtune, torchao and the package's training modules), the tests'
# reward components; and transformers' model classes (~2 s on 2 cores), which every run of a transformers model
# (model.backend: auto, images in the prompt, the checks that load a saved directory) would import itself: the
# one-launch runs of tests/test_models_architectures.py import it in both processes. Not vLLM: the runs that need it
# use the second server below. None of them imports a package of the optional extras' folders (tests/extras.py),
# which a run puts first on its PYTHONPATH (a forked command keeps what the server imported, and finds the rest on
# its own PYTHONPATH).
MODULES = [
    "torch", "torchtune", "torchtune._cli.tune", "torch.distributed.run", "grpo_full_finetune_distributed",
    "grpo_lora_finetune_distributed", "tests._rewards", "transformers", "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
]
# A second server for the runs whose generation engine is vLLM's: MODULES and vLLM (with its in-process engine's
# module), which each of their ranks would import itself (~10 s on 2 cores). Its imports set a few environment
# variables, which scripts/fork_stages.py sets again in each child, as the rank's own import of vLLM would. It
# starts with the PYTHONPATH pytest started with (no extra's folder, tests/extras.py), and a run whose PYTHONPATH
# adds a folder holding a module it imported (the verifiers extra's openai: vLLM imports the venv's) uses the
# plain server instead (scripts/fork_stages.py would run it in a fresh interpreter).
VLLM_MODULES = [*MODULES, "vllm", "vllm.entrypoints.llm"]

_servers: Dict[bool, subprocess.Popen] = {}
_dirs: Dict[bool, Path] = {}


def _stop() -> None:
    for vllm, server in _servers.items():
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(_dirs[vllm], ignore_errors=True)


def forked(command: List[str], env: Dict[str, str], server_env: Dict[str, str], vllm: bool = False) -> List[str]:
    """``command`` (``[TUNE, "run", ...]``) as a child of this process's fork server, and ``env`` (the
    command's) updated in place so that torchrun's ranks are forked children too. The server starts at the
    first call, in ``server_env`` (the tests' plain ``tune run`` environment, tests/recipe_utils.py
    ``tune_env()``: what the imports see; each command then runs in its own ``env``). ``vllm``: the server that
    has imported vLLM too (:data:`VLLM_MODULES`; ``server_env`` must then hold the PYTHONPATH pytest started with),
    unless ``env``'s PYTHONPATH adds a folder that holds a module it imported."""
    _start(vllm, server_env)
    if vllm and _shadowed(env, server_env):
        vllm = False
        _start(vllm, server_env)
    env["PYTHON_EXEC"] = str(_dirs[vllm] / "python")
    return [sys.executable, str(FORK_STAGES), "run", str(_dirs[vllm] / "s.sock"), *command]


def python(server_env: Dict[str, str], vllm: bool = False) -> str:
    """A stand-in for the interpreter (``SHIM [-u] SCRIPT|-m MODULE ARG...``): an executable that runs its
    arguments in a child forked from this process's fork server (``vllm``: the one that imported vLLM), started in
    ``server_env`` (as for :func:`forked`) if it is not running. The tests' ``vllm serve`` processes start through
    it (``TORCHTUNE_GRPO_VLLM_PYTHON``, torchtune_grpo/generation/_vllm_server_process.py): vLLM's API server then
    skips its ~11-14 s of imports on 2 cores."""
    _start(vllm, server_env)
    return str(_dirs[vllm] / "python")


def _shadowed(env: Dict[str, str], server_env: Dict[str, str]) -> bool:
    """Whether ``env``'s PYTHONPATH adds a folder holding a module that vLLM's server imported (waiting for its
    imports; only for a PYTHONPATH that adds a folder)."""
    server, caller = server_env.get("PYTHONPATH", ""), env.get("PYTHONPATH", "")
    if not set(caller.split(os.pathsep)) - set(server.split(os.pathsep)):
        return False
    names = _dirs[True] / "s.sock.modules"
    deadline = time.monotonic() + 600
    while not (_dirs[True] / "s.sock").exists():  # the names are written before the socket appears
        if _servers[True].poll() is not None or time.monotonic() > deadline:
            return True  # the command's `run` reports the missing server
        time.sleep(0.05)
    spec = importlib.util.spec_from_file_location("fork_stages", FORK_STAGES)
    fork_stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fork_stages)
    return bool(fork_stages.shadowed(server, caller, set(names.read_text().split())))


def _start(vllm: bool, server_env: Dict[str, str]) -> subprocess.Popen:
    """The fork server (``vllm``: with vLLM), started if it is not running."""
    server = _servers.get(vllm)
    if server is None or server.poll() is not None:
        if not _servers:
            atexit.register(_stop)
        if server is not None:  # it died (it should not): a new one, in a new directory
            shutil.rmtree(_dirs[vllm], ignore_errors=True)
        _dirs[vllm] = Path(tempfile.mkdtemp(prefix="tune-fork-"))
        sock = _dirs[vllm] / "s.sock"
        # Started from the repository root (sys.path of a script run from elsewhere is the same: PYTHONPATH).
        _servers[vllm] = subprocess.Popen(
            [sys.executable, str(FORK_STAGES), "serve", str(sock), *(VLLM_MODULES if vllm else MODULES)], cwd=REPO,
            env=server_env, stdin=subprocess.DEVNULL)
        _shim(_dirs[vllm] / "python", f'"{sys.executable}" "{FORK_STAGES}" run "{sock}"')
    return _servers[vllm]


def _shim(path: Path, command: str) -> None:
    path.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def forked_commands_path(server_env: Dict[str, str]) -> str:
    """A folder to put first on ``PATH`` of a script (the demo scripts) whose ``tune`` and ``tune-grpo`` are
    children of this process's fork server (its ``tune run``s and ``tune-grpo eval``s start without importing
    torch, torchtune and the recipes again: ~4 s each on 2 busy cores), and whose ``python`` is this
    interpreter, started as usual (the scripts' ``python - <<PY`` and ``python -c`` stay fresh processes).
    ``server_env`` as for :func:`forked`."""
    _start(False, server_env)
    directory = _dirs[False]
    bin_dir = directory / "bin"
    if not bin_dir.is_dir():
        bin_dir.mkdir()
        scripts = Path(sys.executable).parent
        for name in ("tune", "tune-grpo"):  # the console scripts, run by the rank shim as the forked child's __main__
            _shim(bin_dir / name, f'"{directory / "python"}" "{scripts / name}"')
        _shim(bin_dir / "python", f'"{sys.executable}"')
    return str(bin_dir)
