"""What users install is what is tested: the wheel of this checkout, installed non-editable.

``pip install torchtune-grpo`` (or ``pip install .``) gives a wheel, not this checkout. The test builds that
wheel (no setuptools warning allowed), installs it without ``-e`` into a fresh virtual environment outside
the clone, and from another directory runs ``tune-grpo ls``, ``tune-grpo cp`` and one step of each recipe on a
config that ships inside it. The fresh environment takes the run-time dependencies (torch, torchtune's own
dependencies, ...) from the development environment through a ``.pth`` line, so no package is downloaded;
torchtune itself (which provides ``tune``) and this package are installed into it.

It also checks the hand-written package list of pyproject.toml against the tree, so a new folder (code or
data) cannot be left out of the wheel.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.slow

TORCHAO_LINE = "Skipping import of cpp extensions"


def _listed_packages() -> set:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def _folders_that_ship() -> set:
    """Every folder of torchtune_grpo/ and configs/ that holds a file to ship, as a package name."""
    found = set()
    for root, prefix in ((REPO / "torchtune_grpo", "torchtune_grpo"), (REPO / "configs", "torchtune_grpo._configs")):
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or not any(f.is_file() for f in folder.iterdir()):
                continue
            found.add(".".join([prefix, *folder.relative_to(root).parts]))
    return found


def test_pyproject_lists_every_folder_that_ships():
    listed, present = _listed_packages(), _folders_that_ship()
    assert present - listed == set(), f"folders missing from [tool.setuptools] packages in pyproject.toml: {present - listed}"
    assert listed - present == set(), f"packages listed in pyproject.toml that are not in the tree: {listed - present}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(bin_dir, env, workdir)`` of a fresh virtual environment with the wheel installed non-editable."""
    root = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the checkout without its build outputs: setuptools builds in the source tree, and a
    # build/ left by an earlier build would put modules that no longer exist (or that the package list
    # misses) into the wheel.
    source = root / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "outputs", ".whl",
        "gpu_check_out", ".extras"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"),
         str(source)], capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    # setuptools' warnings are classes named ...Warning (distutils' lowercase "warning: byte-compiling is
    # disabled" lines are not warnings about the package).
    warnings = [line for line in (build.stdout + build.stderr).splitlines() if "Warning:" in line]
    assert warnings == [], "the wheel build warns:\n" + "\n".join(warnings)
    (wheel,) = (root / "dist").glob("torchtune_grpo-*.whl")

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    target = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    # The dependencies come from this interpreter's site-packages, appended after the fresh one's: its
    # editable install of this checkout is not active there (a .pth line adds a path; it does not run the
    # editable finder's .pth), and the wheel's modules come first.
    Path(target, "_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--ignore-installed",
         "torchtune==0.6.1", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    workdir = root / "work"
    workdir.mkdir()
    return venv / "bin", env, workdir


def _run(installed, *command: str) -> str:
    bin_dir, env, workdir = installed
    proc = subprocess.run([str(bin_dir / command[0]), *command[1:]], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(command)} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def test_the_installed_package_is_the_wheel_not_this_checkout(installed):
    bin_dir, _, _ = installed
    # The recipe module is found, not imported (importing it is torch's and torchtune's ~5 s of imports): the file
    # an import would load; the one-step runs below import and run it from the wheel.
    out = _run(installed, "python", "-c",
               "import importlib.util, torchtune_grpo; print('FILES', torchtune_grpo.__file__, "
               "importlib.util.find_spec('grpo_full_finetune_distributed').origin)")
    files = out.split("FILES ")[-1].split()
    assert all(f.startswith(str(bin_dir.parent)) for f in files), files


def test_tune_grpo_lists_and_copies_a_shipped_config(installed):
    listed = _run(installed, "tune-grpo", "ls")
    assert "tiny/full_grpo_cpu" in listed and TORCHAO_LINE not in listed
    _run(installed, "tune-grpo", "cp", "tiny/full_grpo_cpu", "full.yaml")
    assert (installed[2] / "full.yaml").read_text().startswith("# GRPO on a tiny Qwen2-shaped model")


@pytest.mark.parametrize("recipe, kind", [("grpo_full_finetune_distributed", "full"),
                                          ("grpo_lora_finetune_distributed", "lora")])
def test_one_step_of_each_recipe_from_the_wheel(installed, recipe, kind):
    _, _, workdir = installed
    config = f"{kind}_step.yaml"
    _run(installed, "tune-grpo", "cp", f"tiny/{kind}_grpo_cpu", config)
    out_dir = workdir / f"out_{kind}"
    out = _run(installed, "tune", "run", recipe, "--config", config, "max_steps=1", f"output_dir={out_dir}")
    # Only `tune` itself may say it (it imports torchtune before the recipe runs; torchtune_grpo/runtime/quiet.py).
    assert out.count(TORCHAO_LINE) <= 1, out
    assert (out_dir / "step_1").is_dir()
    assert '"step": 1' in (out_dir / "metrics.jsonl").read_text()
