"""The run's plain-file logs (metrics.jsonl, completions.jsonl), written beside the configured metric logger."""

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["JsonlWriter", "RunLogs", "rewind_jsonl"]


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible instead of crashing the run
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the current line.

    Args:
        path (str | Path): file to append to (parent directories are created).
    """

    def __init__(self, path: "str | Path") -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: Dict[str, Any]) -> None:
        """Append ``record`` (tensor scalars are converted to numbers)."""
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def write_many(self, records: Iterable[Dict[str, Any]]) -> None:
        """Append several records."""
        for record in records:
            self.write(record)

    def close(self) -> None:
        """Close the file."""
        self._file.close()


def rewind_jsonl(path: "str | Path", step: int) -> int:
    """Cut a run's ``metrics.jsonl``/``completions.jsonl`` back to what a run resumed at ``step`` keeps.

    A run killed after its last checkpoint (step ``step``) has logged steps it will train again when
    resumed: records of later steps go, and so do held-out evaluation records (``eval/*``) of ``step``
    itself, which the resumed run logs again first. Rewritten atomically (temp file + rename); a missing
    file, or a line cut short by the kill, is fine.

    Returns:
        int: the number of records removed.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, removed = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line, half-written when the process was killed
            removed += 1
            continue
        at = record.get("step", 0)
        if at > step or (at == step and any(k.startswith("eval/") for k in record)):
            removed += 1
        else:
            kept.append(line + "\n")
    if removed:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return removed


class RunLogs:
    """Rank 0's records of a run: ``metrics.jsonl`` (every step, every evaluation), ``completions.jsonl``
    and the configured metric logger (every ``log_every_n_steps`` steps; evaluations always).

    Args:
        output_dir (str): the run's output directory.
        metric_logger (Optional[Any]): a torchtune metric logger (``log_dict``, ``close``); None on the other
            ranks, where nothing is written.
        log_every_n_steps (int): the metric logger's period in steps. Default is 1.
    """

    def __init__(self, output_dir: str, metric_logger: Optional[Any], log_every_n_steps: int = 1) -> None:
        self._logger = metric_logger
        self._every = log_every_n_steps
        self._metrics = self._completions = None
        if metric_logger is not None:
            self._metrics = JsonlWriter(os.path.join(output_dir, "metrics.jsonl"))
            self._completions = JsonlWriter(os.path.join(output_dir, "completions.jsonl"))

    def log_config(self, cfg: Any) -> None:
        """Hand the run's config to the metric logger (rank 0)."""
        if self._logger is not None:
            self._logger.log_config(cfg)

    def step(self, step: int, metrics: Dict[str, Any], samples: List[Dict[str, Any]]) -> None:
        """Record training step ``step``: its metrics and its logged completions."""
        if self._logger is None:
            return
        self._metrics.write({"step": step, **metrics})
        self._completions.write_many(samples)
        if step % self._every == 0:
            self._logger.log_dict(metrics, step=step)

    def evaluation(self, step: int, metrics: Dict[str, float]) -> None:
        """Record a held-out evaluation after training step ``step`` (0: before training)."""
        if self._logger is None:
            return
        self._metrics.write({"step": step, **metrics})
        self._logger.log_dict(metrics, step=step)

    def close(self) -> None:
        """Close the files and the metric logger."""
        if self._logger is None:
            return
        self._logger.close()
        self._metrics.close()
        self._completions.close()
