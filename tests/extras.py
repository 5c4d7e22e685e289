"""The optional extras' folders (scripts/install_extra.py) on the path of a test and of what it launches.

scripts/setup_env.sh installs each extra (reasoning-gym, openenv, verifiers) into ``$VENV/extras/<name>``, a
folder of its own holding only what the venv lacks, because verifiers pins ``mcp==2.0.0`` and ``openai<3`` while
OpenEnv's fastmcp works with the venv's newer ones. In the test process every folder is appended to ``sys.path``
(after the venv's packages, so both adapters import together, with the venv's mcp and openai); a process a test
starts gets only the folder it needs, first on ``PYTHONPATH`` (:func:`extra_pythonpath`), so a verifiers run
uses verifiers' own pins. An extra that is neither there nor installed fails the test, naming the command that
installs it: these tests never skip (CI installs every extra). ``TORCHTUNE_GRPO_EXTRAS`` points at another
folder of extras.
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


def add_to_path(name: str) -> bool:
    """Appends the extra's folder to ``sys.path`` if it exists (after the venv's own packages)."""
    folder = extras_root() / name
    if not folder.is_dir():
        return False
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
        importlib.invalidate_caches()
    return True


def use_extra(name: str) -> None:
    """Makes the extra importable in this process, or fails the test saying how to install it."""
    add_to_path(name)
    try:
        importlib.import_module(MODULES[name])
    except ImportError as e:
        pytest.fail(
            f"the {name!r} extra is needed by this test and is not installed ({e}): run scripts/setup_env.sh, or "
            f"python scripts/install_extra.py {name} {extras_root() / name}"
        )


def extra_pythonpath(monkeypatch, name: str, *more: str) -> None:
    """``PYTHONPATH`` for the processes this test starts: ``more`` and the extra's folder first (if installed in a
    folder), then what was there, minus the other extras' folders (a verifiers folder would shadow OpenEnv's mcp)."""
    others = {str(extras_root() / other) for other in MODULES if other != name}
    kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in others]
    folder = extras_root() / name
    first = [*more, str(folder)] if folder.is_dir() else list(more)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(first + kept))
