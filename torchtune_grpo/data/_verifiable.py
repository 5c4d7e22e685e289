"""Question/answer datasets from any ``datasets.load_dataset`` source."""

from typing import Any, Dict, Optional, Sequence, Union

from torchtune_grpo.data._files import check_loaded, load_error
from torchtune_grpo.data._prompt import PromptDataset
from torchtune_grpo.data._rows import describe_source

# Builders that read local files (``data_files``); they have no named configs such as gsm8k's "main".
_FILE_BUILDERS = ("json", "csv", "parquet", "arrow", "text", "pandas")


def load_rows(
    source: str,
    *,
    name: Optional[str] = None,
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    **load_dataset_kwargs,
):
    """Loads one split with ``datasets.load_dataset``.

    Args:
        source (str): hub dataset name, local dataset directory, or a file builder
            (``"json"``, ``"csv"``, ``"parquet"``, ...) used together with ``data_files``.
        name (Optional[str]): dataset config name. Ignored for file builders, which have none.
            Default is None.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        **load_dataset_kwargs: passed to ``datasets.load_dataset`` (e.g. ``cache_dir``).

    Returns:
        datasets.Dataset: the split.

    Raises:
        DataFileError: (a ValueError) when local files cannot be read: an empty file, a byte that is not
            UTF-8, a line that is not JSON... The message names the file and, where found, the line.
    """
    # Imported here so that importing torchtune_grpo.data stays cheap.
    from datasets import load_dataset

    if source in _FILE_BUILDERS:
        name = None
    encoding = load_dataset_kwargs.get("encoding")
    try:
        dataset = load_dataset(source, name, split=split, data_files=data_files, **load_dataset_kwargs)
    except Exception as e:  # noqa: BLE001 - StopIteration and reader errors too; re-raised below
        better = load_error(e, source, data_files, encoding)
        if better is None:
            raise
        raise better from e
    # pyarrow's JSON reader keeps strings that are not UTF-8; they would fail at the first read of the row.
    check_loaded(dataset, source, data_files, encoding)
    return dataset


def require_columns(dataset, columns: Sequence[str], source: str) -> None:
    """Raises a ValueError naming the missing column, the source and the columns that exist.

    Args:
        dataset: a ``datasets.Dataset``.
        columns (Sequence[str]): required column names.
        source (str): the source, for the message.

    Raises:
        ValueError: if a column is missing.
    """
    existing = list(dataset.column_names)
    for column in columns:
        if column not in existing:
            raise ValueError(
                f"column '{column}' not found in dataset source '{source}'; "
                f"available columns: {existing}"
            )


def verifiable_dataset(
    tokenizer,
    source: str,
    question_column: str = "question",
    answer_column: str = "answer",
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    name: Optional[str] = None,
    max_prompt_length: Optional[int] = 256,
    prompt_style: str = "r1",
    system_prompt: Optional[str] = None,
    on_invalid_row: str = "drop",
    **load_dataset_kwargs,
) -> PromptDataset:
    """Prompt dataset of questions with verifiable answers from any ``load_dataset`` source.

    Extra columns pass through to rewards (e.g. ``test_cases`` for a code reward).

    Example YAML::

        dataset:
          _component_: torchtune_grpo.data.verifiable_dataset
          source: json
          data_files: /data/math.jsonl
          question_column: problem
          answer_column: solution

    Args:
        tokenizer: a torchtune model tokenizer.
        source (str): hub name, local dataset directory, or ``"json"``/``"csv"``/``"parquet"`` with
            ``data_files``.
        question_column (str): column with the question. Default is ``"question"``.
        answer_column (str): column with the gold answer (stored as ``str`` under ``"answer"``).
            Default is ``"answer"``.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        name (Optional[str]): dataset config name. Default is None.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 256.
        prompt_style (str): ``"r1"`` or ``"chat"``. Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is None (the built-in R1 instruction).
        on_invalid_row (str): a row whose question or answer is empty or null (a CSV cell left empty, a JSON
            ``null``) is dropped (``"drop"``, the count is logged) or refused (``"error"``, naming the row and
            the column). Default is ``"drop"``.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        PromptDataset: the prompts.

    Raises:
        ValueError: if the question or answer column is missing (the message lists the columns), or a
            row's is empty with ``on_invalid_row="error"``.
    """
    rows = load_rows(
        source, name=name, split=split, data_files=data_files, **load_dataset_kwargs
    )
    require_columns(rows, [question_column, answer_column], source)
    return PromptDataset(
        rows,
        tokenizer,
        formatter=prompt_style,
        max_prompt_length=max_prompt_length,
        question_column=question_column,
        answer_column=answer_column,
        system_prompt=system_prompt,
        source_name=describe_source(source, split, data_files),
        on_invalid_row=on_invalid_row,
    )
