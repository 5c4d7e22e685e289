"""Supervised warm-start data: the GRPO prompt followed by a worked response in the think/answer format.

A short SFT run on such data before GRPO teaches a model the output format (so the format and answer
rewards are not all zero at the start). The prompt tokens are exactly those the GRPO dataset builders
produce for the same question and ``prompt_style``, so the warm-started model continues the RL prompt the
way it was taught. Items are ``{"tokens", "labels"}``, what torchtune's SFT recipes
(``full_finetune_single_device``, ``lora_finetune_single_device``, ``full_finetune_distributed``...)
and ``torchtune.data.padded_collate_sft`` expect.
"""

import logging
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from torch.utils.data import Dataset

from torchtune_grpo.data._gsm8k import GSM8K_ANSWER_MARKER
from torchtune_grpo.data._math import extract_boxed_answer
from torchtune_grpo.data._rows import describe_source, InvalidRows
from torchtune_grpo.data._templates import make_prompt_formatter
from torchtune_grpo.data._verifiable import load_rows, require_columns

__all__ = ["ANSWER_FORMATS", "R1_RESPONSE_TEMPLATE", "WarmStartDataset", "sft_dataset"]

log = logging.getLogger(__name__)

#: How the response is written after the R1 prompt (which already ends with ``<think>``).
R1_RESPONSE_TEMPLATE = "{reasoning}\n</think>\n<answer>\n{answer}\n</answer>"
#: Valid ``answer_format`` values of :func:`sft_dataset`.
ANSWER_FORMATS = ("plain", "gsm8k", "boxed")

# GSM8K calculator annotations: "48/2 = <<48/2=24>>24" -> "48/2 = 24".
_CALCULATOR = re.compile(r"<<[^<>]*>>")
CROSS_ENTROPY_IGNORE_IDX = -100


class LabelledItems(Dataset):
    """In-memory SFT items ``{"tokens", "labels"}``, those longer than ``max_seq_len`` dropped (with a warning).

    Args:
        examples (Iterable[Tuple[List[int], List[int]]]): ``(tokens, labels)`` per example, equal lengths.
        total (int): how many examples ``examples`` yields (for the messages).
        max_seq_len (Optional[int]): longer examples are dropped, not truncated.
        what (str): what the examples are, plural (``"SFT examples"``), for the messages.

    Raises:
        ValueError: if every example was dropped or there are none.
    """

    def __init__(self, examples: Iterable[Tuple[List[int], List[int]]], total: int, max_seq_len: Optional[int],
                 what: str) -> None:
        self._items: List[Dict[str, List[int]]] = []
        dropped = 0
        for tokens, labels in examples:
            if max_seq_len is not None and len(tokens) > max_seq_len:
                dropped += 1
                continue
            self._items.append({"tokens": tokens, "labels": list(labels)})
        self.num_dropped = dropped
        if dropped:
            log.warning(f"dropped {dropped} of {total} {what} longer than max_seq_len={max_seq_len}")
        if not self._items:
            raise ValueError(
                f"no {what} left: all {total} are longer than max_seq_len={max_seq_len}" if total else f"no {what}"
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> Dict[str, List[int]]:
        item = self._items[index]
        return {"tokens": list(item["tokens"]), "labels": list(item["labels"])}


class WarmStartDataset(LabelledItems):
    """Tokenized prompt + response pairs for SFT.

    Each item is ``{"tokens": prompt + response + [stop], "labels": same length}``; labels are
    ``-100`` over the prompt (unless ``train_on_input``), unshifted (torchtune's SFT recipes shift them).

    Args:
        pairs (Sequence[Dict[str, str]]): ``{"question": ..., "response": ...}`` items.
        tokenizer: a torchtune model tokenizer.
        prompt_style (str): ``"r1"`` or ``"chat"``, as for the GRPO dataset. Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is None (the built-in R1 instruction).
        max_seq_len (Optional[int]): longer examples are dropped (not truncated: a cut response teaches a
            cut answer). Default is None (no limit).
        train_on_input (bool): also train on the prompt tokens. Default is False.

    Raises:
        ValueError: if every example was dropped or there are none.
    """

    def __init__(
        self,
        pairs: Sequence[Dict[str, str]],
        tokenizer,
        prompt_style: str = "r1",
        system_prompt: Optional[str] = None,
        max_seq_len: Optional[int] = None,
        train_on_input: bool = False,
    ) -> None:
        formatter = make_prompt_formatter(prompt_style, system_prompt=system_prompt)
        # The response ends with the token generation stops on: the end-of-turn token for chat prompts
        # (Llama 3's <|eot_id|>; Qwen's eos is already <|im_end|>), else the eos token.
        stop = getattr(tokenizer, "eot_id", None) if prompt_style == "chat" else None
        stop = tokenizer.eos_id if stop is None else stop

        def examples():
            for pair in pairs:
                prompt, _ = formatter(tokenizer, str(pair["question"]))
                response = list(tokenizer.encode(str(pair["response"]), add_bos=False, add_eos=False)) + [stop]
                tokens = list(prompt) + response
                yield tokens, tokens if train_on_input else [CROSS_ENTROPY_IGNORE_IDX] * len(prompt) + response

        super().__init__(examples(), len(pairs), max_seq_len, "SFT examples")


def _response_parts(row: Dict[str, Any], index: int, answer_format: str, answer_column: str,
                    reasoning_column: Optional[str], source: str) -> Dict[str, str]:
    if answer_format == "gsm8k":
        text = str(row[answer_column])
        if GSM8K_ANSWER_MARKER not in text:
            raise ValueError(f"row {index} of {source} has no '{GSM8K_ANSWER_MARKER}' in '{answer_column}'")
        reasoning, answer = text.rsplit(GSM8K_ANSWER_MARKER, 1)
        return {"reasoning": _CALCULATOR.sub("", reasoning).strip(), "answer": answer.strip()}
    if answer_format == "boxed":
        solution = str(row[reasoning_column or "solution"])
        answer = extract_boxed_answer(solution)
        if answer is None:
            raise ValueError(f"row {index} of {source} has no \\boxed{{}} answer in '{reasoning_column or 'solution'}'")
        return {"reasoning": solution.strip(), "answer": answer}
    reasoning = str(row[reasoning_column]).strip() if reasoning_column else ""
    return {"reasoning": reasoning, "answer": str(row[answer_column]).strip()}


def sft_dataset(
    tokenizer,
    source: str,
    question_column: str = "question",
    answer_column: str = "answer",
    reasoning_column: Optional[str] = None,
    response_column: Optional[str] = None,
    answer_format: str = "plain",
    response_template: str = R1_RESPONSE_TEMPLATE,
    split: str = "train",
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    name: Optional[str] = None,
    prompt_style: str = "r1",
    system_prompt: Optional[str] = None,
    max_seq_len: Optional[int] = None,
    train_on_input: bool = False,
    packed: bool = False,
    on_invalid_row: str = "drop",
    **load_dataset_kwargs,
) -> WarmStartDataset:
    """SFT warm-start dataset for torchtune's SFT recipes, in the GRPO prompt/response format.

    The response is ``response_column`` verbatim when given; otherwise ``response_template`` filled with
    ``{reasoning}`` and ``{answer}``, read according to ``answer_format``:

    - ``"plain"``: ``answer`` from ``answer_column``, ``reasoning`` from ``reasoning_column`` (or empty);
    - ``"gsm8k"``: ``answer_column`` holds a GSM8K solution ``"steps #### 72"``: the steps (calculator
      annotations ``<<...>>`` removed) are the reasoning, the text after ``####`` the answer;
    - ``"boxed"``: ``reasoning_column`` (default ``"solution"``) holds a MATH solution: it is the reasoning,
      its last ``\\boxed{}`` the answer.

    Example YAML for ``tune run full_finetune_single_device`` (GSM8K, local file)::

        dataset:
          _component_: torchtune_grpo.data.sft_dataset
          source: json
          data_files: /data/gsm8k/train.jsonl
          answer_format: gsm8k
          max_seq_len: 1024

    Args:
        tokenizer: a torchtune model tokenizer.
        source (str): hub name, local dataset directory, or a file builder with ``data_files``.
        question_column (str): column with the question. Default is ``"question"``.
        answer_column (str): column with the answer (or GSM8K solution). Default is ``"answer"``.
        reasoning_column (Optional[str]): column with the reasoning (or MATH solution). Default is None.
        response_column (Optional[str]): column with a complete response. Default is None.
        answer_format (str): one of :data:`ANSWER_FORMATS`. Default is ``"plain"``.
        response_template (str): template with ``{reasoning}`` and ``{answer}``.
            Default is :data:`R1_RESPONSE_TEMPLATE`.
        split (str): split to load. Default is ``"train"``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        name (Optional[str]): config name (ignored for file builders). Default is None.
        prompt_style (str): ``"r1"`` or ``"chat"``: use the same as the GRPO run. Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text, the same as the GRPO run. Default is None.
        max_seq_len (Optional[int]): longer examples are dropped. Default is None.
        train_on_input (bool): also train on the prompt. Default is False.
        packed (bool): sample packing; not supported (torchtune's recipes pass the key through).
            Default is False.
        on_invalid_row (str): a row whose question, answer, reasoning or response (the columns in use) is empty
            or null (a CSV cell left empty, a JSON ``null``) is dropped (``"drop"``: the count is logged) or
            refused (``"error"``: the message names the row and the column). Default is ``"drop"``.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        WarmStartDataset: items ``{"tokens", "labels"}``.

    Raises:
        ValueError: on a missing column, an unknown ``answer_format``, ``packed=True``, or a row without
            its answer (the message names the row).
    """
    if packed:
        raise ValueError("sft_dataset does not support packed=True")
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {list(ANSWER_FORMATS)}, got {answer_format!r}")
    rows = load_rows(source, name=name, split=split, data_files=data_files, **load_dataset_kwargs)
    if response_column is not None:
        needed = [question_column, response_column]
    elif answer_format == "boxed":
        needed = [question_column, reasoning_column or "solution"]
    else:
        needed = [question_column, answer_column] + ([reasoning_column] if reasoning_column else [])
    require_columns(rows, needed, source)
    source_name = describe_source(source, split, data_files)
    invalid = InvalidRows(on_invalid_row, source_name)
    pairs = []
    for index, row in enumerate(rows):
        # Before the response is built: a null cell would be the text "None" in the trained response.
        if invalid.skip(row, index, needed):
            continue
        if response_column is not None:
            response = str(row[response_column])
        else:
            parts = _response_parts(row, index, answer_format, answer_column, reasoning_column, source_name)
            response = response_template.format(**parts)
        pairs.append({"question": row[question_column], "response": response})
    invalid.report(len(rows))
    return WarmStartDataset(
        pairs,
        tokenizer,
        prompt_style=prompt_style,
        system_prompt=system_prompt,
        max_seq_len=max_seq_len,
        train_on_input=train_on_input,
    )
