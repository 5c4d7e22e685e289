"""What every benchmark here shares: the recipe module, child processes (ours and TRL's Python), memory and
load readings, report files.

A benchmark runs as ``python benchmarks/NAME.py`` (its directory is then on ``sys.path``, so ``import
harness`` and another benchmark's module import as they are); tests load them through
``tests/conftest.load_benchmark``, which does the same. Each side of a comparison runs in a fresh child
process (:func:`run_child`) with a fixed thread count, so the two sides are measured alike and one side's
imports (``trl`` lives in its own environment: ``--trl-python``) never reach the other.
"""

import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]

__all__ = [
    "REPO", "ChildRun", "RssSampler", "child_env", "current_rss", "loadavg", "read_jsonl", "recipe_module",
    "run_child", "write_report",
]


def recipe_module(name: str = "grpo_full_finetune_distributed") -> ModuleType:
    """One of the recipes (``recipes/NAME.py``; installed as top-level modules, DESIGN.md), imported from this
    checkout."""
    recipes = str(REPO / "recipes")
    if recipes not in sys.path:
        sys.path.insert(0, recipes)
    return importlib.import_module(name)


# Set by a recipe for its one-process group in the parent: a child (TRL's side) must not join that group.
_PROCESS_GROUP_VARS = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


def child_env(threads: Optional[int]) -> Dict[str, str]:
    """The environment of a child: ``threads`` intra-op threads (OpenMP, MKL, no tokenizer pool; None keeps
    the parent's), this checkout first on PYTHONPATH (``torchtune_grpo`` and test components import from it),
    and none of the parent's process-group variables."""
    env = {k: v for k, v in os.environ.items() if k not in _PROCESS_GROUP_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


class ChildRun(NamedTuple):
    """A finished child process: its wall-clock seconds, peak resident memory (bytes) and output."""

    seconds: float
    peak_rss: int
    output: str


def run_child(
    python: str, script: Path, args: Sequence[str], *, threads: Optional[int], log: Optional[Path] = None
) -> ChildRun:
    """Run ``python script args...`` with ``threads`` threads; raise with the output's tail when it fails.

    Args:
        python (str): the interpreter (ours, or the TRL environment's ``--trl-python``).
        script (Path): the benchmark file (its child modes are command-line arguments).
        args (Sequence[str]): the arguments.
        threads (Optional[int]): intra-op threads of the child; None: the parent's setting.
        log (Optional[Path]): also append the output to this file. Default is None.

    Returns:
        ChildRun: seconds, peak RSS (``ru_maxrss`` of the child via ``wait4``) and output.

    Raises:
        RuntimeError: on a non-zero exit, naming the mode (``args[0]``) and the log.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [python, str(script), *args], env=child_env(threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    output = proc.stdout.read().decode(errors="replace")
    _, status, rusage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if log is not None:
        with open(log, "a", encoding="utf-8") as f:
            f.write(output)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.stderr.write(output[-6000:])
        raise RuntimeError(f"{args[0] if args else script.name} failed (exit {code})" + (f"; log: {log}" if log else ""))
    return ChildRun(seconds, rusage.ru_maxrss * 1024, output)  # ru_maxrss is in KiB on Linux


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds in a thread; ``peak`` is the largest seen (bytes)."""

    def __init__(self, interval: float = 0.02) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __enter__(self) -> "RssSampler":
        self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def current_rss() -> int:
    """This process's resident memory in bytes."""
    import psutil

    return psutil.Process().memory_info().rss


def loadavg() -> str:
    """The 1/5/15-minute load averages, for every report (timings on a busy machine mean little)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """The records of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_report(report: Dict[str, Any], out: Optional[Path], markdown: Optional[str] = None) -> None:
    """Print ``markdown`` (or the JSON) and, with ``out``, write ``out`` (JSON) and ``out`` with ``.md`` beside it."""
    text = json.dumps(report, indent=2)
    print(markdown if markdown is not None else text)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        if markdown is not None:
            out.with_suffix(".md").write_text(markdown + "\n")
