"""GSM8K (grade-school math word problems)."""

from typing import Any, Dict, Optional, Sequence, Union

from torchtune_grpo.data._prompt import PromptDataset
from torchtune_grpo.data._rows import describe_source, InvalidRows
from torchtune_grpo.data._verifiable import load_rows, require_columns

# GSM8K solutions end with "#### <final answer>".
GSM8K_ANSWER_MARKER = "####"


def extract_gsm8k_answer(solution: str) -> Optional[str]:
    """Returns the final answer of a GSM8K solution (the text after the last ``####``), stripped.

    The raw string is kept (``"1,000"`` stays ``"1,000"``): numeric normalisation is the reward's job.

    Args:
        solution (str): the GSM8K ``answer`` field.

    Returns:
        Optional[str]: the final answer, or None if there is no ``####``.
    """
    if GSM8K_ANSWER_MARKER not in solution:
        return None
    return solution.rsplit(GSM8K_ANSWER_MARKER, 1)[1].strip()


def gsm8k_dataset(
    tokenizer,
    source: str = "openai/gsm8k",
    name: Optional[str] = "main",
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    max_prompt_length: Optional[int] = 256,
    prompt_style: str = "r1",
    system_prompt: Optional[str] = None,
    on_invalid_row: str = "drop",
    **load_dataset_kwargs,
) -> PromptDataset:
    """GSM8K prompts. ``answer`` is the final answer; the full worked solution is kept as ``solution``.

    Example YAML (local copy, no hub access needed)::

        dataset:
          _component_: torchtune_grpo.data.gsm8k_dataset
          source: json
          data_files: /data/gsm8k/train.jsonl

    Args:
        tokenizer: a torchtune model tokenizer.
        source (str): hub name, local dataset directory, or a file builder (``"json"``, ``"parquet"``,
            ...) with ``data_files``. Default is ``"openai/gsm8k"``.
        name (Optional[str]): config name, ignored for file builders. Default is ``"main"``.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 256.
        prompt_style (str): ``"r1"`` or ``"chat"``. Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is None (the built-in R1 instruction).
        on_invalid_row (str): a row whose question, answer, or final answer after ``####`` is empty or null (a
            CSV cell left empty, a JSON ``null``) is dropped (``"drop"``: the count is logged) or refused
            (``"error"``: the message names the row and the column). Default is ``"drop"``.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        PromptDataset: the prompts.

    Raises:
        ValueError: if the ``question``/``answer`` columns are missing or a row's answer has no ``####``
            (the message names the row index).
    """
    dataset = load_rows(
        source, name=name, split=split, data_files=data_files, **load_dataset_kwargs
    )
    require_columns(dataset, ["question", "answer"], source)

    source_name = describe_source(source, split, data_files)
    invalid = InvalidRows(on_invalid_row, source_name)
    rows = []
    for index, row in enumerate(dataset):
        # Checked before parsing: a null answer would be the text "None", which has no "####".
        if invalid.skip(row, index, ["question", "answer"]):
            continue
        gold = extract_gsm8k_answer(str(row["answer"]))
        if gold is not None and invalid.skip({"answer": gold}, index, ["answer"]):
            continue  # "... ####" with nothing after it
        if gold is None:
            raise ValueError(
                f"row {index} of {source_name} has no '{GSM8K_ANSWER_MARKER}' "
                f"in its answer: {str(row['answer'])[:200]!r}"
            )
        rows.append({**row, "answer": gold, "solution": row["answer"]})
    invalid.report(len(dataset))

    return PromptDataset(
        rows,
        tokenizer,
        formatter=prompt_style,
        max_prompt_length=max_prompt_length,
        system_prompt=system_prompt,
        source_name=source_name,
        on_invalid_row=on_invalid_row,
    )
