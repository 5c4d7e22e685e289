"""Code problems: a prompt plus test cases, scored by running the model's program (``CodeExecutionReward``)."""

from typing import Any, Dict, Optional, Sequence, Union

from torchtune_grpo.data._prompt import PromptDataset
from torchtune_grpo.data._rows import describe_source, InvalidRows
from torchtune_grpo.data._verifiable import load_rows, require_columns
from torchtune_grpo.rewards.code_tests import normalize_tests

__all__ = ["CODE_SYSTEM_PROMPT", "code_dataset"]

#: Instruction for code tasks: reason in <think>, then give the program in a fenced python block.
CODE_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User gives a programming task and the Assistant "
    "solves it in Python. The Assistant first thinks about the solution and then gives the complete "
    "program. The reasoning is enclosed within <think> </think> and the program within <answer> </answer> "
    "as a fenced code block, i.e., <think> reasoning </think> <answer>\n```python\nprogram\n```\n</answer>."
)


def code_dataset(
    tokenizer,
    source: str,
    prompt_column: str = "prompt",
    tests_column: str = "tests",
    solution_column: Optional[str] = None,
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    name: Optional[str] = None,
    max_prompt_length: Optional[int] = 512,
    prompt_style: str = "r1",
    system_prompt: Optional[str] = CODE_SYSTEM_PROMPT,
    on_invalid_row: str = "drop",
    **load_dataset_kwargs,
) -> PromptDataset:
    """Code prompts with test cases, from any ``datasets.load_dataset`` source.

    Each sample carries ``tests``: the row's test cases, normalised by
    :func:`~torchtune_grpo.rewards.normalize_tests` (assert statements, or stdin/stdout pairs; a JSON string
    column is parsed), which is what ``CodeExecutionReward`` reads. ``answer`` is the reference solution
    when ``solution_column`` is given, else empty. Every other column passes through.

    Example YAML::

        dataset:
          _component_: torchtune_grpo.data.code_dataset
          source: json
          data_files: /data/mbpp/train.jsonl
          prompt_column: text
          tests_column: test_list
        reward_functions:
          - _component_: torchtune_grpo.rewards.CodeExecutionReward
            time_limit: 10

    Args:
        tokenizer: a torchtune model tokenizer.
        source (str): hub name, local dataset directory, or a file builder (``"json"``, ``"parquet"``...)
            with ``data_files``.
        prompt_column (str): column with the task. Default is ``"prompt"``.
        tests_column (str): column with the test cases. Default is ``"tests"``.
        solution_column (Optional[str]): column with a reference solution. Default is None.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        name (Optional[str]): config name (ignored for file builders). Default is None.
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 512.
        prompt_style (str): ``"r1"`` or ``"chat"``. Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is :data:`CODE_SYSTEM_PROMPT`.
        on_invalid_row (str): a row whose task (or reference solution, when ``solution_column`` is given) is
            empty or null (a CSV cell left empty, a JSON ``null``) is dropped (``"drop"``: the count is logged)
            or refused (``"error"``: the message names the row and the column). Default is ``"drop"``.
            Test cases are not judged here: empty or malformed ones are always an error.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        PromptDataset: the prompts.

    Raises:
        ValueError: if a column is missing or a row's test cases are empty or malformed (the message names
            the row).
    """
    rows = load_rows(source, name=name, split=split, data_files=data_files, **load_dataset_kwargs)
    require_columns(rows, [prompt_column, tests_column] + ([solution_column] if solution_column else []), source)
    source_name = describe_source(source, split, data_files)
    invalid = InvalidRows(on_invalid_row, source_name)
    out = []
    for index, row in enumerate(rows):
        if invalid.skip(row, index, [prompt_column] + ([solution_column] if solution_column else [])):
            continue
        try:
            tests = normalize_tests(row[tests_column])
        except ValueError as e:
            raise ValueError(f"row {index} of {source_name}: bad '{tests_column}': {e}") from None
        sample = dict(row)
        sample["question"] = row[prompt_column]
        sample["tests"] = tests
        sample["answer"] = str(row[solution_column]) if solution_column else ""
        out.append(sample)
    invalid.report(len(rows))
    return PromptDataset(
        out,
        tokenizer,
        formatter=prompt_style,
        max_prompt_length=max_prompt_length,
        system_prompt=system_prompt,
        source_name=source_name,
        on_invalid_row=on_invalid_row,
        # Without a reference solution the answer is empty by design.
        required_columns=["question"] + (["answer"] if solution_column else []),
    )
