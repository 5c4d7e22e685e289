"""The demo scripts outside an activated environment (issue 33): they use the clone's .venv when it exists,
and otherwise stop saying how to set it up, not with a bare ModuleNotFoundError."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ("demo.sh", "demo_multi_turn.sh", "demo_process_rewards.sh", "demo_images.sh")


def _clone(tmp_path: Path) -> Path:
    """A copy of the scripts in a fresh 'clone' (no .venv), so the test does not depend on this one's."""
    root = tmp_path / "clone"
    shutil.copytree(REPO / "scripts", root / "scripts")
    return root


def _bare_env(tmp_path: Path) -> dict:
    """An environment whose `python` is the base interpreter, without this project's packages: what a user
    who did not activate .venv has."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(os.path.realpath(sys.executable))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    env["DEMO_DIR"] = str(tmp_path / "work")
    env["DEMO_GRPO_STEPS"] = "0"  # the multi-turn demo stops after locating the shipped warm start
    return env


def _run(script: Path, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_base_interpreter_cannot_import_the_package(tmp_path):
    # The premise of the tests below: without the venv, `python` lacks torchtune_grpo.
    env = _bare_env(tmp_path)
    out = subprocess.run(["python", "-c", "import torchtune_grpo"], env=env, cwd=tmp_path, capture_output=True,
                         text=True)
    assert out.returncode != 0 and "No module named 'torchtune_grpo'" in out.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_without_venv_the_demo_says_how_to_set_up(tmp_path, script):
    clone = _clone(tmp_path)
    out = _run(clone / "scripts" / script, _bare_env(tmp_path), cwd=tmp_path)
    assert out.returncode == 1
    assert "ModuleNotFoundError" not in out.stderr
    assert "cannot import torchtune_grpo" in out.stderr and "make setup" in out.stderr
    assert f". {clone}/.venv/bin/activate" in out.stderr
    assert not (tmp_path / "work").exists()  # stopped before doing anything


def test_the_clones_venv_is_used_when_not_active(tmp_path):
    clone = _clone(tmp_path)
    venv_bin = clone / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    # Stands in for the clone's venv: the interpreter this test runs in, which has torchtune_grpo.
    (venv_bin / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv_bin / "python").chmod(0o755)
    out = _run(clone / "scripts" / "demo_multi_turn.sh", _bare_env(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"using the project's virtual environment {clone}/.venv" in out.stdout
    assert "DEMO_GRPO_STEPS=0: stopping after the warm start" in out.stdout
