"""Question/answer datasets from any ``datasets.load_dataset`` source."""

from typing import Any, Dict, Optional, Sequence, Union

from torchtune_grpo.data._prompt import PromptDataset

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
    """
    # Imported here so that importing torchtune_grpo.data stays cheap.
    from datasets import load_dataset

    if source in _FILE_BUILDERS:
        name = None
    return load_dataset(source, name, split=split, data_files=data_files, **load_dataset_kwargs)


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
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        PromptDataset: the prompts.

    Raises:
        ValueError: if the question or answer column is missing (the message lists the columns).
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
        source_name=f"'{source}' split '{split}'",
    )
