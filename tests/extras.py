"""The optional extras' folders (scripts/install_extra.py) on the path of a test and of what it launches.

scripts/setup_env.sh installs each extra (reasoning-gym, openenv, verifiers) into ``$VENV/extras/<name>``,
a folder of its own, because verifiers and OpenEnv need different ``mcp`` versions. A test that needs one
calls :func:`use_extra`: the folder goes on ``sys.path`` and on ``PYTHONPATH`` (for the ``tune run`` and
server processes it starts). An extra that is neither there nor installed in the interpreter fails the
test, naming the command that installs it: these tests never skip (CI installs every extra).
``TORCHTUNE_GRPO_EXTRAS`` points at another folder of extras.
"""

import importlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MODULES = {"reasoning-gym": "reasoning_gym", "openenv": "openenv.core", "verifiers": "verifiers.v1"}


def extras_root() -> Path:
    return Path(os.environ.get("TORCHTUNE_GRPO_EXTRAS") or REPO / ".venv" / "extras")


# verifiers pins older versions of packages the venv has (openai < 3): its folder goes first on sys.path, as
# PYTHONPATH puts it first in the processes a test starts. The others only hold what the venv lacks.
FIRST = {"verifiers"}


def add_to_path(name: str) -> bool:
    """Puts the extra's folder on ``sys.path`` and ``PYTHONPATH`` if it exists."""
    folder = extras_root() / name
    if not folder.is_dir():
        return False
    if str(folder) not in sys.path:
        if name in FIRST:
            sys.path.insert(0, str(folder))
        else:
            sys.path.append(str(folder))  # after the venv's own packages
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(folder) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(paths + [str(folder)])
    importlib.invalidate_caches()
    return True


def use_extra(name: str) -> None:
    """Makes the extra importable here and in child processes, or fails the test saying how to install it."""
    add_to_path(name)
    try:
        importlib.import_module(MODULES[name])
    except ImportError as e:
        pytest.fail(
            f"the {name!r} extra is needed by this test and is not installed ({e}): run scripts/setup_env.sh, or "
            f"python scripts/install_extra.py {name} {extras_root() / name}"
        )
