"""Prompt datasets for GRPO: each item is ``{"tokens", "prompt", "answer", ...}`` (docs/architecture.md)."""

from torchtune_grpo.data._arithmetic import arithmetic_dataset, arithmetic_problems
from torchtune_grpo.data._gsm8k import extract_gsm8k_answer, gsm8k_dataset
from torchtune_grpo.data._prompt import collate_prompts, PromptBatch, PromptDataset
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
from torchtune_grpo.data._verifiable import load_rows, require_columns, verifiable_dataset

__all__ = [
    "arithmetic_dataset",
    "arithmetic_problems",
    "ChatPrompt",
    "collate_prompts",
    "decode_prompt",
    "extract_gsm8k_answer",
    "gsm8k_dataset",
    "load_rows",
    "make_prompt_formatter",
    "PROMPT_STYLES",
    "PromptBatch",
    "PromptDataset",
    "R1_SYSTEM_PROMPT",
    "R1_TEMPLATE",
    "R1Prompt",
    "require_columns",
    "tokenize_chat_prompt",
    "verifiable_dataset",
]
