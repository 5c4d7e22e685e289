"""Install one optional extra of this package into a folder of its own, next to (not into) the venv.

    python scripts/install_extra.py reasoning-gym .venv/extras/reasoning-gym
    python scripts/install_extra.py openenv .venv/extras/openenv
    python scripts/install_extra.py verifiers .venv/extras/verifiers

Why a folder per extra (``pip install --target``): verifiers 0.4 pins ``mcp==2.0.0`` while OpenEnv's fastmcp
wants an older mcp, so the two cannot share one environment; each test (and each `tune run` it starts) puts
only the folder it needs on its path (tests/extras.py). Why only the missing packages: ``pip install --target``
ignores what the venv has and would install a second torch/numpy there. So pip first resolves the extra
against this interpreter (``--dry-run --report``: exactly what ``pip install ".[extra]"`` would add to the
venv), then installs just those distributions, with ``--no-deps``, into the folder.

The requirement of each extra is read from pyproject.toml (``[project.optional-dependencies]``), so the
versions are declared once. Set ``EXTRA_NO_DEPS`` (space-separated names) to skip dependencies that the
adapter does not import (e.g. OpenEnv's web UI, gradio).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent

# Dependencies that the adapters never import, left out of CI's folders to keep setup short. The extras
# users install with pip still pull them (they are the packages' own requirements).
SKIP = {
    # OpenEnv's optional web UI (openenv.core imports it only when ENABLE_WEB_INTERFACE is set)
    "openenv": {"gradio", "gradio-client", "hf-gradio", "pillow", "pydub", "brotli", "groovy", "safehttpx",
                "semantic-version", "tomlkit", "orjson"},
}


def requirements(extra: str) -> list:
    """The extra's requirement strings from pyproject.toml."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    if extra not in extras:
        sys.exit(f"pyproject.toml has no extra {extra!r}; it has {sorted(extras)}")
    return extras[extra]


def missing(reqs: list) -> list:
    """``name==version`` of every distribution pip would add to this interpreter's environment for ``reqs``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                        *reqs], check=True)
        install = json.loads(report.read_text())["install"]
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in install]


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    extra, target = sys.argv[1], Path(sys.argv[2])
    skip = SKIP.get(extra, set()) | set(os.environ.get("EXTRA_NO_DEPS", "").split())
    wanted = [p for p in missing(requirements(extra)) if p.split("==")[0].lower().replace("_", "-") not in skip]
    print(f"{extra}: installing {len(wanted)} distributions into {target}: {' '.join(wanted)}", flush=True)
    target.mkdir(parents=True, exist_ok=True)
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target",
                        str(target), *wanted], check=True)


if __name__ == "__main__":
    main()
