"""Prompt dataset and collate function (the data contract in docs/architecture.md)."""

import logging
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Union

from torch.utils.data import Dataset
from tqdm.auto import tqdm

from torchtune_grpo.data._rows import InvalidRows
from torchtune_grpo.data._templates import PromptFormatter, make_prompt_formatter

logger = logging.getLogger(__name__)

# Above this many rows, tokenizing takes long enough to deserve a progress bar.
_PROGRESS_MIN_ROWS = 1000


class PromptBatch(NamedTuple):
    """A batch of prompts, kept as lists (prompts have different lengths).

    Attributes:
        tokens (List[List[int]]): prompt token ids per sample.
        prompts (List[str]): prompt text per sample.
        fields (List[Dict[str, Any]]): every key of each sample except ``tokens``
            (``answer``, ``prompt`` and any passthrough columns), handed to rewards.
    """

    tokens: List[List[int]]
    prompts: List[str]
    fields: List[Dict[str, Any]]


def collate_prompts(samples: List[Mapping[str, Any]]) -> PromptBatch:
    """Collates prompt samples into a :class:`PromptBatch` without padding.

    Padding is left to the generator, which knows its pad id and whether it pads left or right.

    Args:
        samples (List[Mapping[str, Any]]): samples from a :class:`PromptDataset`.

    Returns:
        PromptBatch: tokens, prompt texts and the remaining fields, in sample order.
    """
    return PromptBatch(
        tokens=[list(s["tokens"]) for s in samples],
        prompts=[s["prompt"] for s in samples],
        fields=[{k: v for k, v in s.items() if k != "tokens"} for s in samples],
    )


class PromptDataset(Dataset):
    """Prompts for RL: question rows formatted, tokenized once and filtered by length.

    Each item is a dict ``{"tokens": List[int], "prompt": str, "answer": str, **other_columns}``.
    ``tokens``, ``prompt`` and ``answer`` are set here (an existing ``prompt`` column is overwritten);
    every other column of the row passes through unchanged, so rewards can read it.

    Args:
        rows (Iterable[Mapping[str, Any]]): the rows, e.g. a ``datasets.Dataset`` or a list of dicts.
        tokenizer: a torchtune model tokenizer (``encode``; ``tokenize_messages`` for chat prompts).
        formatter (Union[str, PromptFormatter]): ``"r1"``, ``"chat"`` or a callable
            ``(tokenizer, question) -> (tokens, prompt_text)``. Default is ``"r1"``.
        max_prompt_length (Optional[int]): prompts with more tokens than this are dropped (not
            truncated: a truncated question has no reliable answer). None keeps every prompt.
            Default is 256.
        question_column (str): column holding the question. Default is ``"question"``.
        answer_column (str): column holding the gold answer, stored as ``str`` under ``"answer"``.
            Default is ``"answer"``.
        system_prompt (Optional[str]): instruction text for the built-in styles. Default is None
            (the style's default).
        source_name (str): name used in messages. Default is ``"rows"``.
        on_invalid_row (str): what to do with a row whose value in ``required_columns`` is empty or null
            (None, NaN, blank text: a CSV cell left empty, a JSON ``null``): ``"drop"`` skips it (the count
            is logged) or ``"error"`` raises naming the row and the column. Default is ``"drop"``.
        required_columns (Optional[Sequence[str]]): the columns that must hold a value. Default is None:
            the question and answer columns.

    Raises:
        ValueError: if a row lacks the question or answer column, has an empty one with
            ``on_invalid_row="error"``, or every prompt was dropped.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]],
        tokenizer,
        formatter: Union[str, PromptFormatter] = "r1",
        max_prompt_length: Optional[int] = 256,
        *,
        question_column: str = "question",
        answer_column: str = "answer",
        system_prompt: Optional[str] = None,
        source_name: str = "rows",
        on_invalid_row: str = "drop",
        required_columns: Optional[Sequence[str]] = None,
    ):
        invalid = InvalidRows(on_invalid_row, source_name)
        if required_columns is None:
            required_columns = (question_column, answer_column)
        self._tokenizer = tokenizer
        self._formatter = make_prompt_formatter(formatter, system_prompt=system_prompt)
        self.max_prompt_length = max_prompt_length

        try:
            total = len(rows)  # type: ignore[arg-type]
        except TypeError:
            total = None
        iterator = rows
        if total is None or total > _PROGRESS_MIN_ROWS:
            iterator = tqdm(rows, total=total, desc="Tokenizing prompts", leave=False)

        self._samples: List[Dict[str, Any]] = []
        num_rows = 0
        for index, row in enumerate(iterator):
            num_rows += 1
            for column in (question_column, answer_column):
                if column not in row:
                    raise ValueError(
                        f"row {index} of {source_name} has no column '{column}'; "
                        f"columns: {sorted(row.keys())}"
                    )
            if invalid.skip(row, index, required_columns):
                continue
            tokens, text = self._formatter(tokenizer, str(row[question_column]))
            if max_prompt_length is not None and len(tokens) > max_prompt_length:
                continue
            sample = dict(row)
            sample["tokens"] = tokens
            sample["prompt"] = text
            sample["answer"] = str(row[answer_column]).strip()
            self._samples.append(sample)

        invalid.report(num_rows)
        self.num_rows = num_rows
        self.num_invalid = invalid.num_dropped
        self.num_dropped = num_rows - len(self._samples) - self.num_invalid
        if self.num_dropped:
            logger.warning(
                f"dropped {self.num_dropped} of {num_rows} prompts longer than "
                f"max_prompt_length={max_prompt_length} tokens"
            )
        if not self._samples:
            raise ValueError(
                f"no prompts left from {source_name}: {num_rows} rows, all longer than "
                f"max_prompt_length={max_prompt_length} tokens"
                + (f" or with an empty or null value ({self.num_invalid})" if self.num_invalid else "")
                if num_rows
                else f"{source_name} has no rows"
            )

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = self._samples[index]
        # Shallow copy so a consumer editing its sample (or tokens) cannot change the dataset.
        out = dict(sample)
        out["tokens"] = list(sample["tokens"])
        return out
