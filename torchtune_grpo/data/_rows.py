"""Rows with an empty or missing question or answer: dropped with a count in the log, or refused.

A CSV cell left empty reaches us as None (``str(None)`` is the text ``"None"``), a JSON ``null`` as None,
a missing number as NaN. Trained on, such a row teaches nothing (an empty prompt) or rewards the wrong
thing (the gold answer ``"None"`` scores 1.0 for ``<answer>None</answer>``), so every prompt builder checks
its question and answer columns here before it formats anything.
"""

import logging
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Union

__all__ = ["InvalidRows", "ON_INVALID_ROW", "check_on_invalid_row", "describe_source", "is_blank"]

log = logging.getLogger(__name__)

#: Valid ``on_invalid_row`` values: ``"drop"`` skips the row (counted in one warning), ``"error"`` raises.
ON_INVALID_ROW = ("drop", "error")


def check_on_invalid_row(on_invalid_row: str) -> str:
    """Returns ``on_invalid_row`` if it is one of :data:`ON_INVALID_ROW`.

    Raises:
        ValueError: naming the key and the valid values otherwise.
    """
    if on_invalid_row not in ON_INVALID_ROW:
        raise ValueError(f"on_invalid_row must be one of {list(ON_INVALID_ROW)}, got {on_invalid_row!r}")
    return on_invalid_row


def is_blank(value: Any) -> bool:
    """Whether a cell holds no usable text: None, NaN, a string of only whitespace, or an empty list/dict.

    ``0``, ``False`` and ``"0"`` are values, not blanks.
    """
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, str):
        return not value.strip()
    if isinstance(value, (list, tuple, dict)):
        return len(value) == 0
    return False


def describe_source(
    source: str,
    split: Optional[str] = None,
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
) -> str:
    """The dataset's name for messages: ``'json' split 'train' (data_files: /data/train.jsonl)``.

    Args:
        source (str): the ``load_dataset`` source.
        split (Optional[str]): the split. Default is None.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): the files, named when given so an
            error points at the file to fix. Default is None.

    Returns:
        str: the description.
    """
    text = f"'{source}'"
    if split is not None:
        text += f" split '{split}'"
    if data_files:
        if isinstance(data_files, dict) and split in data_files:
            data_files = data_files[split]
        text += f" (data_files: {data_files})"
    return text


class InvalidRows:
    """Checks rows for blank values (see :func:`is_blank`) while a builder reads them, and reports the drops.

    A builder calls :meth:`skip` on each row as loaded, with the row's index in the split (0-based; for one
    JSONL file without blank lines, row ``i`` is line ``i + 1``), and :meth:`report` once after the last row.

    Args:
        on_invalid_row (str): ``"drop"`` or ``"error"`` (see :data:`ON_INVALID_ROW`).
        source_name (str): the dataset, for messages (see :func:`describe_source`).

    Raises:
        ValueError: if ``on_invalid_row`` is not valid.
    """

    def __init__(self, on_invalid_row: str, source_name: str) -> None:
        self.on_invalid_row = check_on_invalid_row(on_invalid_row)
        self.source_name = source_name
        self.counts: Dict[str, int] = {}

    @property
    def num_dropped(self) -> int:
        """Rows skipped so far."""
        return sum(self.counts.values())

    def skip(self, row: Mapping[str, Any], index: int, columns: Sequence[str]) -> bool:
        """Whether to skip ``row``: True when a value in ``columns`` is blank (``on_invalid_row="drop"``).

        Columns the row lacks are not checked here (the builders report missing columns themselves).

        Args:
            row (Mapping[str, Any]): the row.
            index (int): its index in the split.
            columns (Sequence[str]): the columns that must hold a value, in the order to report them.

        Returns:
            bool: True when the row is to be dropped.

        Raises:
            ValueError: with ``on_invalid_row="error"``, naming the source, the row and the column.
        """
        column = next((c for c in columns if c in row and is_blank(row[c])), None)
        if column is None:
            return False
        if self.on_invalid_row == "error":
            raise ValueError(
                f"row {index} (0-based) of {self.source_name} has an empty or null '{column}' "
                f"({row[column]!r}); fix the data, or set on_invalid_row: drop to skip such rows"
            )
        self.counts[column] = self.counts.get(column, 0) + 1
        return True

    def report(self, num_rows: int) -> None:
        """Logs how many of ``num_rows`` rows were dropped, per column (nothing when none was).

        Args:
            num_rows (int): the rows read.

        Raises:
            ValueError: when every row was dropped.
        """
        if not self.counts:
            return
        detail = ", ".join(f"'{c}': {n}" for c, n in self.counts.items())
        if self.num_dropped >= num_rows:
            raise ValueError(
                f"no rows left from {self.source_name}: all {num_rows} have an empty or null value ({detail})"
            )
        log.warning(
            f"dropped {self.num_dropped} of {num_rows} rows of {self.source_name} with an empty or null value "
            f"({detail}); on_invalid_row: error refuses them instead"
        )
