"""Chat prompts with torchtune tokenizers: generation prompts and their decoded text.

The chat prompt style of the datasets and the model judge build prompts the same way, through
:func:`tokenize_chat_prompt`.
"""

import inspect
from typing import Callable, List

from torchtune.data import Message

__all__ = ["decode_prompt", "tokenize_chat_prompt"]


def _kwargs_supported(fn: Callable, **kwargs) -> dict:
    """Keeps only the keyword arguments that ``fn`` accepts.

    torchtune tokenizers disagree on names: Qwen2 uses ``add_eos`` in ``tokenize_messages`` and
    ``skip_special_tokens`` in ``decode``; Llama3 uses ``add_end_tokens`` and also has
    ``truncate_at_eos``.
    """
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def decode_prompt(tokenizer, tokens: List[int]) -> str:
    """Decodes prompt ids to text, keeping special tokens (so chat prompts show their markers).

    Args:
        tokenizer: a torchtune model tokenizer.
        tokens (List[int]): token ids.

    Returns:
        str: the decoded text, special tokens included where the tokenizer allows it.
    """
    kwargs = _kwargs_supported(
        tokenizer.decode, skip_special_tokens=False, truncate_at_eos=False
    )
    return tokenizer.decode(tokens, **kwargs)


def tokenize_chat_prompt(tokenizer, messages: List[Message]) -> List[int]:
    """Tokenizes messages as a generation prompt: ends with the assistant header, no end token.

    The last message must be an empty assistant message: torchtune's Qwen2/Qwen2.5 tokenizers then
    emit ``<|im_start|>assistant\\n`` without ``<|im_end|>``, and Llama3 emits
    ``<|start_header_id|>assistant<|end_header_id|>\\n\\n`` without ``<|eot_id|>`` once end tokens
    are turned off (``add_eos=False`` for Qwen, ``add_end_tokens=False`` for Llama3).

    Args:
        tokenizer: a torchtune model tokenizer with ``tokenize_messages``.
        messages (List[Message]): the conversation, ending with an empty assistant message.

    Returns:
        List[int]: prompt token ids.

    Raises:
        TypeError: if the tokenizer has no way to turn end tokens off.
    """
    kwargs = _kwargs_supported(
        tokenizer.tokenize_messages, add_eos=False, add_end_tokens=False
    )
    if not kwargs:
        raise TypeError(
            f"{type(tokenizer).__name__}.tokenize_messages takes neither add_eos nor add_end_tokens, "
            "so a generation prompt cannot be built with prompt_style='chat'; use prompt_style='r1'"
        )
    tokens, _ = tokenizer.tokenize_messages(messages, **kwargs)
    return list(tokens)
