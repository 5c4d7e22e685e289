"""Naming the file and line behind a data file that ``datasets.load_dataset`` cannot read.

``load_dataset`` reports a broken local file without naming it: a byte that is not UTF-8 surfaces as a bare
``UnicodeDecodeError``, a cut JSONL line as ``Expected object or value``, an empty file as a bare
``StopIteration``. A JSONL string that is not UTF-8 even loads without complaint (pyarrow's JSON reader
does not check) and fails later, on the first read of the row, far from its cause: :func:`check_loaded`
validates the loaded table at once. When loading local files fails, :func:`diagnose_data_files` reads
them again itself to find the first empty file, the first byte that is not UTF-8 or the first line that
is not JSON, and :func:`load_error` turns that into one message naming the file and the line.
"""

import glob
import json
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

__all__ = ["DataFileError", "check_loaded", "diagnose_data_files", "load_error", "local_data_files"]

# Builders whose files are text we can check line by line; parquet and arrow are binary.
_TEXT_BUILDERS = ("json", "csv", "text")
_EXTENSION_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "csv", ".txt": "text"}
# Compressed files are not decompressed here: only an empty one is diagnosed.
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")


class DataFileError(ValueError):
    """A local data file could not be read; the message names the file and, where known, the line."""


def local_data_files(
    source: str, data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None
) -> List[str]:
    """The local files a ``load_dataset(source, data_files=...)`` call reads, in order (globs expanded).

    Args:
        source (str): a file builder (``"json"``...), a local directory, or a hub name (no local files).
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): a path, a list, or a dict of
            split to path(s). Default is None.

    Returns:
        List[str]: the existing local files; empty for a hub dataset.
    """
    if data_files is None:
        if not os.path.isdir(source):
            return []
        found = []
        for root, _, names in os.walk(source):
            found += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        return sorted(found)
    patterns: List[str] = []

    def add(value: Any) -> None:
        if isinstance(value, (str, os.PathLike)):
            patterns.append(os.fspath(value))
        elif isinstance(value, dict):
            for v in value.values():
                add(v)
        elif isinstance(value, (list, tuple)) or hasattr(value, "__iter__"):
            for v in value:
                add(v)

    add(data_files)
    files: List[str] = []
    for pattern in patterns:
        if os.path.isdir(source) and not os.path.isabs(pattern):
            pattern = os.path.join(source, pattern)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        files += [m for m in matches if os.path.isfile(m) and m not in files]
    return files


def _builder_for(path: str, source: str) -> Optional[str]:
    if source in _TEXT_BUILDERS:
        return source
    return _EXTENSION_BUILDERS.get(os.path.splitext(path)[1].lower())


def _lines(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from f


def _utf8_problem(path: str) -> Optional[str]:
    """The first line holding a byte sequence that is not UTF-8, streamed so a large file is never held
    in memory at once."""
    offset = 0
    for number, line in enumerate(_lines(path), start=1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            return (
                f"data file {path}, line {number}: byte {line[e.start:e.start + 1]!r} at byte offset "
                f"{offset + e.start} (column {e.start + 1} of the line) is not valid UTF-8 ({e.reason}); "
                "save the file as UTF-8"
            )
        offset += len(line)
    return None


def _json_problem(path: str) -> Optional[str]:
    """The first line of a JSON Lines file that is not one JSON value; a single JSON document (an array or
    an object over several lines) is judged as a whole instead."""
    first_bad = None
    parsed_lines = 0
    for number, line in enumerate(_lines(path), start=1):
        text = line.decode("utf-8").strip()
        if not text:
            continue
        try:
            json.loads(text)
            parsed_lines += 1
        except json.JSONDecodeError as e:
            first_bad = (number, e)
            break
    if first_bad is None:
        return None
    number, error = first_bad
    if parsed_lines == 0:
        # Maybe one JSON document over many lines rather than JSON Lines: judge the whole file.
        with open(path, encoding="utf-8") as f:
            whole = f.read()
        try:
            json.loads(whole)
            return None
        except json.JSONDecodeError as e:
            if e.lineno > 1 or whole.lstrip().startswith("["):
                return f"data file {path}, line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})"
    return (
        f"data file {path}, line {number}, column {error.colno}: not a valid JSON object ({error.msg}); "
        "each line of a JSON Lines file must be one complete JSON object (a line cut short?)"
    )


def diagnose_data_files(files: Sequence[str], source: str, encoding: Optional[str] = None) -> Optional[str]:
    """Finds the first problem in ``files`` that makes them unreadable: an empty file, a byte that is not
    UTF-8, a line that is not JSON (JSON Lines).

    Args:
        files (Sequence[str]): local files, in the order they are read.
        source (str): the ``load_dataset`` builder (``"json"``, ``"csv"``...) or a directory (the builder
            then follows each file's extension).
        encoding (Optional[str]): an ``encoding`` passed to ``load_dataset``; the UTF-8 check is skipped for
            any other. Default is None (UTF-8).

    Returns:
        Optional[str]: a message naming the file (and line), or None when none of these problems is found.
    """
    utf8 = encoding is None or encoding.lower().replace("_", "-") in ("utf-8", "utf8", "utf-8-sig")
    for path in files:
        if os.path.getsize(path) == 0:
            return f"data file {path} is empty (0 bytes)"
        builder = _builder_for(path, source)
        if builder not in _TEXT_BUILDERS or path.lower().endswith(_COMPRESSED):
            continue
        if utf8:
            problem = _utf8_problem(path)
            if problem:
                return problem
        if not any(line.strip() for line in _lines(path)):
            return f"data file {path} holds only blank lines"
        if builder == "json" and utf8:
            problem = _json_problem(path)
            if problem:
                return problem
    return None


def _describe_cause(error: BaseException) -> str:
    # datasets wraps the reader's error ("An error occurred while generating the dataset"): name the
    # innermost one too, which says what the reader saw.
    inner = error
    seen = {id(error)}
    while (inner.__cause__ or inner.__context__) is not None and id(inner.__cause__ or inner.__context__) not in seen:
        inner = inner.__cause__ or inner.__context__
        seen.add(id(inner))
    text = f"{type(error).__name__}: {error}".strip().rstrip(":")
    if inner is not error:
        text += " <- " + f"{type(inner).__name__}: {inner}".strip().rstrip(":")
    return text


def load_error(
    error: BaseException,
    source: str,
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]],
    encoding: Optional[str] = None,
) -> Optional[DataFileError]:
    """The error to raise instead of ``error`` from ``load_dataset`` over local files, or None to re-raise
    ``error`` itself (a hub dataset, a missing file: those messages already name their cause).

    Args:
        error (BaseException): what ``load_dataset`` raised.
        source (str): its ``source`` (builder, directory or hub name).
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): its ``data_files``.
        encoding (Optional[str]): its ``encoding`` keyword, if any. Default is None.

    Returns:
        Optional[DataFileError]: naming the file and, where found, the line.
    """
    if isinstance(error, FileNotFoundError):
        return None
    files = local_data_files(source, data_files)
    if not files:
        return None
    try:
        problem = diagnose_data_files(files, source, encoding)
    except OSError as e:  # the file vanished or is unreadable: say so rather than hide the first error
        problem = f"data file {getattr(e, 'filename', None) or files} could not be read again: {e}"
    cause = _describe_cause(error)
    if problem is None:
        return DataFileError(f"could not load {source!r} from {files}: {cause}")
    return DataFileError(f"{problem} (loading {source!r} failed with {cause})")


def check_loaded(
    dataset: Any,
    source: str,
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]],
    encoding: Optional[str] = None,
) -> None:
    """Validates a freshly loaded dataset's arrow table in full (every string UTF-8, every offset in range).

    Args:
        dataset (Any): what ``load_dataset`` returned (a ``datasets.Dataset``; anything without an arrow
            table, e.g. a streaming dataset, is not checked).
        source (str): its ``source``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): its ``data_files``.
        encoding (Optional[str]): its ``encoding`` keyword, if any. Default is None.

    Raises:
        DataFileError: naming the file and line when the table is invalid.
    """
    table = getattr(getattr(dataset, "data", None), "table", None)
    if table is None or not hasattr(table, "validate"):
        return
    try:
        table.validate(full=True)
    except Exception as e:  # noqa: BLE001 - pyarrow.ArrowInvalid; turned into a message naming the file
        raise (load_error(e, source, data_files, encoding) or DataFileError(f"{source!r}: {e}")) from e
