"""Download the wheels a bare GPU machine lacks for scripts/gpu_check.sh, and check they fit what can travel.

The target (docs/gpu.md): Python 3.12 on manylinux x86-64, with torch 2.11 (CUDA), transformers, peft,
accelerate, safetensors, tokenizers, pytest and the packages in :data:`IMAGE` preinstalled; no network.
What it lacks travels as wheels in the git-ignored ``.whl/`` folder, together with the source tree, at
most 64 MiB in all (:data:`LIMIT_BYTES`).

The wheel set is :data:`CARRY` (exact versions). After downloading, every ``Requires-Dist`` of every
carried wheel (markers evaluated for CPython 3.12 on Linux x86-64, extras not requested) must be carried,
on the image, or named in :data:`NOT_NEEDED` with the reason import does not need it; anything else is an
error. Then the sizes are added up: the wheels plus the files that travel with the source tree (tracked
and untracked-but-not-ignored files, as ``git ls-files -co --exclude-standard`` lists them).

    python scripts/gpu_wheels.py                 # download into .whl/, check, print the table
    python scripts/gpu_wheels.py --dest DIR      # elsewhere (scripts/setup_env.sh: the CI rehearsal's set)
    python scripts/gpu_wheels.py --check-only    # no download: check the wheels already in --dest
    python scripts/gpu_wheels.py --this-python --dest DIR   # the same versions for this interpreter and
                                                 # platform: the CPU rehearsal's set (scripts/setup_env.sh)

Exit status 1 when a requirement is unaccounted for or the total is over the limit.
"""

import argparse
import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 64 * 2**20

# What travels, with why each is needed (exact versions: the set that was rehearsed on CPU).
CARRY: Dict[str, Tuple[str, str]] = {
    "torchtune": ("0.6.1", "the library this package extends"),
    # 0.14.1-0.15 are the torchao releases torchtune 0.6.1 imports and runs with (README, Install).
    "torchao": ("0.15.0", "torchtune imports it (NF4 for QLoRA, quantisation APIs)"),
    "torchdata": ("0.11.0", "torchtune pins it; the recipe's StatefulDataLoader"),
    # 2.4 vendors its ANTLR runtime (omegaconf/vendor/antlr4): no antlr4-python3-runtime needed.
    "omegaconf": ("2.4.0", "torchtune's and the recipes' configs"),
    # 4.8.5, not 5.x: 5.x requires pyarrow >= 24, newer than the image may have; 4.8.5 needs >= 21.
    "datasets": ("4.8.5", "torchtune imports it at `import torchtune`; TRL's GRPOTrainer takes a Dataset"),
    "dill": ("0.4.1", "datasets"),
    "multiprocess": ("0.70.19", "datasets"),
    "jsonschema": ("4.26.0", "torchtune_grpo.multiturn (tool arguments), imported with the recipes"),
    "jsonschema-specifications": ("2025.9.1", "jsonschema"),
    "referencing": ("0.37.0", "jsonschema"),
    "rpds-py": ("2026.9.1", "jsonschema (compiled: cp312 manylinux)"),
    "trl": ("1.16.0", "the GRPOTrainer the GPU check compares step times with"),
    # `tune` (torchtune/_cli/tune.py) imports its download subcommand, which imports kagglehub: without
    # it `tune run` fails before running anything.
    "kagglehub": ("1.0.3", "the `tune` command line (tune run) imports it"),
    "kagglesdk": ("0.1.38", "kagglehub"),
}

# Declared requirements that nothing on the GPU check's path imports.
NOT_NEEDED: Dict[str, str] = {
    "blobfile": "torchtune: only tiktoken model files on cloud storage",
    "antlr4-python3-runtime": "omegaconf 2.4 vendors it",
    "torch": "on the image (2.11)",
}

# Python packages of the GPU image ('cuda'), as the device notes list them (read on a machine 2026-11-17).
IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())

PIP_TARGET = [
    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
    "--abi", "abi3", "--abi", "none",
    *[arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                      "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
      for arg in ("--platform", tag)],
]


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    """The normalised distribution name of a wheel file."""
    return normalize(path.name.split("-")[0])


def requirements(wheel: Path) -> List[str]:
    """The wheel's ``Requires-Dist`` names that apply on CPython 3.12 / Linux x86-64 without extras."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    names = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(env):
            names.append(normalize(req.name))
    return names


def check_closure(wheels: List[Path]) -> Tuple[List[Dict[str, str]], List[str]]:
    """Every requirement of every wheel, with where it comes from; and the unaccounted ones."""
    carried = {wheel_name(w) for w in wheels}
    rows, missing = [], []
    for w in wheels:
        for req in requirements(w):
            if req in carried:
                where = "carried"
            elif req in IMAGE:
                where = "image"
            elif req in NOT_NEEDED:
                where = "not needed: " + NOT_NEEDED[req]
            else:
                where = "MISSING"
                missing.append(f"{wheel_name(w)} -> {req}")
            rows.append({"wheel": wheel_name(w), "requires": req, "from": where})
    return rows, missing


def tree_bytes(repo: Path) -> int:
    """Bytes of the files that travel with the source tree (tracked + untracked, not ignored); outside a
    git checkout, every file but ``.git``, virtual environments and ``.whl`` (an over-estimate)."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                             capture_output=True).stdout.decode()
        files = [repo / f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".whl", ".venv"}
        files = [f for f in repo.rglob("*") if not skip & {p.split("-")[0] for p in f.relative_to(repo).parts}]
    return sum(f.stat().st_size for f in files if f.is_file())


def download(dest: Path, this_python: bool = False) -> None:
    """``pip download`` exactly :data:`CARRY` into ``dest`` (other wheels there are removed first), for the GPU
    machine's Python and platform, or with ``this_python`` for the running interpreter's."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {normalize(n) for n in CARRY}
    for old in dest.glob("*.whl"):
        if wheel_name(old) not in wanted:
            old.unlink()
    specs = [f"{name}=={version}" for name, (version, _) in CARRY.items()]
    target = ["--only-binary=:all:"] if this_python else PIP_TARGET
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *target, "-d", str(dest), *specs],
                   check=True)


def report(dest: Path, repo: Path = REPO) -> Dict[str, object]:
    """Sizes and the requirement check of the wheels in ``dest``."""
    wheels = sorted(dest.glob("*.whl"))
    names = [wheel_name(w) for w in wheels]
    dupes = sorted({n for n in names if names.count(n) > 1})
    absent = sorted({normalize(n) for n in CARRY} - set(names))
    rows, missing = check_closure(wheels)
    wheel_total = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes(repo)
    return {
        "wheels": [{"file": w.name, "bytes": w.stat().st_size} for w in wheels],
        "wheel_bytes": wheel_total, "tree_bytes": tree, "total_bytes": wheel_total + tree,
        "limit_bytes": LIMIT_BYTES, "requirements": rows, "missing": missing, "duplicates": dupes,
        "absent": absent,
        "ok": not missing and not dupes and not absent and wheel_total + tree <= LIMIT_BYTES,
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--check-only", action="store_true", help="check the wheels already in --dest")
    parser.add_argument("--this-python", action="store_true",
                        help="wheels for this interpreter and platform (the CPU rehearsal), not the GPU machine's")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if not args.check_only:
        download(args.dest, args.this_python)
    r = report(args.dest)
    for w in r["wheels"]:
        print(f"{w['bytes'] / 2**20:8.2f} MiB  {w['file']}")
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    print(f"wheels {mib(r['wheel_bytes'])} + source tree {mib(r['tree_bytes'])} = {mib(r['total_bytes'])} "
          f"(limit {mib(LIMIT_BYTES)})")
    for line in r["missing"]:
        print("MISSING requirement:", line)
    for name in r["duplicates"]:
        print("two versions of", name, "in", args.dest)
    for name in r["absent"]:
        print("not downloaded:", name)
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print("OK" if r["ok"] else "NOT OK")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
