"""Plain-file logs every run writes beside the configured metric logger."""

import json
import math
from pathlib import Path
from typing import Any, Dict, Iterable

__all__ = ["JsonlWriter"]


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
