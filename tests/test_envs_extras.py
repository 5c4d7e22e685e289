"""Without an extra installed, its adapters stop with an error that names the pip extra to install.

The libraries are hidden from a fresh interpreter by an import hook (whatever this machine has installed), so the
test means the same everywhere.
"""

import subprocess
import sys

from tests.conftest import REPO

HIDE = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("reasoning_gym", "openenv", "verifiers"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, Hide())
import torchtune_grpo.envs as envs  # importing the adapters needs none of them
"""


BUILDS = [  # (component, the extra its error must name)
    ("envs.ReasoningGymReward()", "reasoning-gym"),
    ("envs.reasoning_gym_rows('chain_sum')", "reasoning-gym"),
    ("envs.OpenEnvEnvironment(base_url='http://127.0.0.1:1')", "openenv"),
    ("envs.openenv_dataset(None, base_url='http://127.0.0.1:1')", "openenv"),
    ("envs.VerifiersReward('any-taskset')", "verifiers"),
    ("envs.verifiers_dataset(None, 'any-taskset')", "verifiers"),
]


def test_missing_extra_is_named():
    # one interpreter for all (importing torch is most of the time)
    code = HIDE + "".join(f"""
try:
    {build}
    print("BUILT: {build}")
except envs.MissingExtraError as e:
    print("MISSING:", e)
""" for build, _ in BUILDS)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": f"{REPO}:{REPO / 'recipes'}", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("MISSING:", "BUILT:"))]
    assert len(lines) == len(BUILDS), out.stdout + out.stderr[-2000:]
    for line, (build, extra) in zip(lines, BUILDS):
        assert line.startswith("MISSING:") and f'pip install "torchtune-grpo[{extra}]"' in line, (build, line)
