"""MATH (Hendrycks et al. 2021, arXiv:2103.03874): competition problems whose solutions end in ``\\boxed{}``."""

from typing import Any, Dict, Optional, Sequence, Union

from torchtune_grpo.data._prompt import PromptDataset
from torchtune_grpo.data._rows import describe_source, InvalidRows
from torchtune_grpo.data._verifiable import load_rows, require_columns
from torchtune_grpo.rewards.answers import extract_answer

__all__ = ["extract_boxed_answer", "math_dataset"]


def extract_boxed_answer(solution: str) -> Optional[str]:
    """Returns the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of a solution, stripped.

    Nested braces are balanced: ``"so \\boxed{\\frac{1}{2}}"`` gives ``"\\frac{1}{2}"``.

    Args:
        solution (str): a worked solution.

    Returns:
        Optional[str]: the boxed answer, or None when there is none (or it is blank).
    """
    boxed = extract_answer(str(solution), "boxed")
    if boxed is None or not boxed.strip():
        return None
    return boxed.strip()


def math_dataset(
    tokenizer,
    source: str = "DigitalLearningGmbH/MATH-lighteval",
    name: Optional[str] = None,
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    problem_column: str = "problem",
    solution_column: str = "solution",
    answer_column: Optional[str] = None,
    levels: Optional[Sequence[Union[int, str]]] = None,
    max_prompt_length: Optional[int] = 256,
    prompt_style: str = "r1",
    system_prompt: Optional[str] = None,
    on_invalid_row: str = "drop",
    **load_dataset_kwargs,
) -> PromptDataset:
    """MATH-style prompts: ``answer`` is the last ``\\boxed{}`` of the solution (or ``answer_column``).

    Each sample keeps the full ``solution`` and every other column (``level``, ``type``...). Score it with
    ``MathAnswerReward`` (``backend: auto`` uses math-verify when installed, which understands LaTeX
    answers such as ``\\frac{\\sqrt{3}}{2}``).

    Example YAML (a local copy; any ``datasets.load_dataset`` source works)::

        dataset:
          _component_: torchtune_grpo.data.math_dataset
          source: json
          data_files: /data/math/train.jsonl
          levels: [3, 4, 5]

    Args:
        tokenizer: a torchtune model tokenizer.
        source (str): hub name, local dataset directory, or a file builder (``"json"``, ``"parquet"``...)
            with ``data_files``. Default is ``"DigitalLearningGmbH/MATH-lighteval"``.
        name (Optional[str]): config name (ignored for file builders). Default is None.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        problem_column (str): column with the problem. Default is ``"problem"``.
        solution_column (str): column with the worked solution. Default is ``"solution"``.
        answer_column (Optional[str]): column with a ready final answer (MATH-500 style); when given, the
            solution is not parsed and need not exist. Default is None.
        levels (Optional[Sequence[Union[int, str]]]): keep only these levels (``3`` or ``"Level 3"``; the
            ``level`` column must exist). Default is None (all).
        max_prompt_length (Optional[int]): longer prompts are dropped. Default is 256.
        prompt_style (str): ``"r1"`` or ``"chat"``. Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is None (the built-in R1 instruction).
        on_invalid_row (str): a row whose problem or solution (or ``answer_column``) is empty or null (a CSV
            cell left empty, a JSON ``null``) is dropped (``"drop"``: the count is logged) or refused
            (``"error"``: the message names the row and the column). Default is ``"drop"``.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        PromptDataset: the prompts.

    Raises:
        ValueError: if a column is missing, or a solution has no ``\\boxed{}`` answer (the message names the
            row).
    """
    rows = load_rows(source, name=name, split=split, data_files=data_files, **load_dataset_kwargs)
    required = [problem_column, answer_column or solution_column] + (["level"] if levels is not None else [])
    require_columns(rows, required, source)
    wanted = None
    if levels is not None:
        wanted = {f"Level {lv}" if isinstance(lv, int) or str(lv).isdigit() else str(lv) for lv in levels}

    source_name = describe_source(source, split, data_files)
    invalid = InvalidRows(on_invalid_row, source_name)
    out = []
    for index, row in enumerate(rows):
        if invalid.skip(row, index, [problem_column, answer_column or solution_column]):
            continue
        if wanted is not None and str(row["level"]) not in wanted:
            continue
        if answer_column is not None:
            gold = str(row[answer_column]).strip()
        else:
            gold = extract_boxed_answer(row[solution_column])
            if gold is None:
                raise ValueError(
                    f"row {index} of {source_name} has no \\boxed{{}} answer in its "
                    f"'{solution_column}': {str(row[solution_column])[-200:]!r}"
                )
        out.append({**row, "question": row[problem_column], "answer": gold})
    invalid.report(len(rows))
    if not out:
        raise ValueError(f"no rows of {source_name} match levels {sorted(wanted or [])}")
    return PromptDataset(
        out,
        tokenizer,
        formatter=prompt_style,
        max_prompt_length=max_prompt_length,
        system_prompt=system_prompt,
        source_name=source_name,
        on_invalid_row=on_invalid_row,
    )
