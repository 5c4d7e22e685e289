"""Prompt datasets for GRPO: each item is ``{"tokens", "prompt", "answer", ...}`` (docs/architecture.md)."""

from torchtune_grpo.data._arithmetic import (
    addition_sft_rows,
    addition_worked_solution,
    arithmetic_dataset,
    arithmetic_problems,
)
from torchtune_grpo.data._code import CODE_SYSTEM_PROMPT, code_dataset
from torchtune_grpo.data._files import DataFileError
from torchtune_grpo.data._image_sft import image_sft, tiny_gemma3_dir
from torchtune_grpo.data._images import image_dataset, ImagePromptDataset
from torchtune_grpo.data._gsm8k import extract_gsm8k_answer, gsm8k_dataset
from torchtune_grpo.data._math import extract_boxed_answer, math_dataset
from torchtune_grpo.data._prompt import collate_prompts, PromptBatch, PromptDataset
from torchtune_grpo.data._rows import ON_INVALID_ROW
from torchtune_grpo.data._shapes import draw_shapes, SHAPE_COUNT_QUESTION, shape_count_rows, write_shape_count_data
from torchtune_grpo.data._sft import ANSWER_FORMATS, R1_RESPONSE_TEMPLATE, sft_dataset, WarmStartDataset
from torchtune_grpo.data._templates import (
    ChatPrompt,
    decode_prompt,
    make_prompt_formatter,
    PROMPT_STYLES,
    R1_SYSTEM_PROMPT,
    R1_TEMPLATE,
    R1Prompt,
    tokenize_chat_prompt,
)
from torchtune_grpo.data._tool_traces import careless_calculator_traces, tool_sft_dataset, ToolTraceDataset
from torchtune_grpo.data._verifiable import load_rows, require_columns, verifiable_dataset

__all__ = [
    "ANSWER_FORMATS",
    "addition_sft_rows",
    "addition_worked_solution",
    "arithmetic_dataset",
    "arithmetic_problems",
    "careless_calculator_traces",
    "ChatPrompt",
    "CODE_SYSTEM_PROMPT",
    "code_dataset",
    "collate_prompts",
    "DataFileError",
    "decode_prompt",
    "draw_shapes",
    "extract_boxed_answer",
    "extract_gsm8k_answer",
    "gsm8k_dataset",
    "image_dataset",
    "image_sft",
    "ImagePromptDataset",
    "load_rows",
    "make_prompt_formatter",
    "ON_INVALID_ROW",
    "math_dataset",
    "PROMPT_STYLES",
    "PromptBatch",
    "PromptDataset",
    "R1_SYSTEM_PROMPT",
    "R1_RESPONSE_TEMPLATE",
    "R1_TEMPLATE",
    "R1Prompt",
    "require_columns",
    "SHAPE_COUNT_QUESTION",
    "shape_count_rows",
    "sft_dataset",
    "tiny_gemma3_dir",
    "tokenize_chat_prompt",
    "tool_sft_dataset",
    "ToolTraceDataset",
    "verifiable_dataset",
    "write_shape_count_data",
    "WarmStartDataset",
]
