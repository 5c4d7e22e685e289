"""Prompt formats: how a question becomes the token ids that generation continues from.

Two styles are provided:

- ``"r1"``: a raw-text template (no chat special tokens) that instructs the model to reason inside
  ``<think> </think>`` and answer inside ``<answer> </answer>``, and that ends with an opening
  ``<think>`` so the model starts reasoning right away. Suited to base models.
- ``"chat"``: the tokenizer's own chat format (``tokenize_messages``) with an optional system
  message, ending with the assistant header and no end-of-turn token. Suited to instruct models.

A formatter is any callable ``formatter(tokenizer, question) -> (tokens, prompt_text)``.
"""

import inspect
from typing import Callable, List, Optional, Tuple, Union

from torchtune.data import Message

# The instruction shared by both styles. Kept short: it is part of every prompt, so every token of it
# costs prompt length (the tiny demo model uses max_prompt_length=128).
R1_SYSTEM_PROMPT = (
    "The Assistant answers the User's question. It works the problem out step by step between "
    "<think> and </think>, then writes only the final answer between <answer> and </answer>, "
    "like this: <think> step by step work </think> <answer> final answer </answer>."
)

# Raw-text template. It ends with "<think>" so that the first generated token already belongs to the
# reasoning, which is what the format reward expects.
R1_TEMPLATE = "{system_prompt}\nUser: {question}\nAssistant: <think>"

PROMPT_STYLES = ("r1", "chat")

PromptFormatter = Callable[[object, str], Tuple[List[int], str]]


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


class R1Prompt:
    """Raw-text prompt: ``template.format(system_prompt=..., question=...)`` then ``encode``.

    Args:
        system_prompt (Optional[str]): instruction placed before the question. Default is None,
            which uses :data:`R1_SYSTEM_PROMPT`.
        template (str): format string with ``{system_prompt}`` and ``{question}`` fields.
            Default is :data:`R1_TEMPLATE`.
    """

    def __init__(self, system_prompt: Optional[str] = None, template: str = R1_TEMPLATE):
        self.system_prompt = R1_SYSTEM_PROMPT if system_prompt is None else system_prompt
        self.template = template

    def format(self, question: str) -> str:
        """Returns the prompt text for ``question``."""
        return self.template.format(system_prompt=self.system_prompt, question=question)

    def __call__(self, tokenizer, question: str) -> Tuple[List[int], str]:
        text = self.format(question)
        # add_bos: Llama3 needs <|begin_of_text|>; Qwen has no BOS so this adds nothing there.
        # add_eos=False: generation must continue the prompt, not start after an EOS.
        return list(tokenizer.encode(text, add_bos=True, add_eos=False)), text


class ChatPrompt:
    """Chat prompt built with the tokenizer's ``tokenize_messages``.

    Args:
        system_prompt (Optional[str]): system message. Default is None, which uses
            :data:`R1_SYSTEM_PROMPT` (so the model is told the ``<think>/<answer>`` format);
            pass ``""`` for no system message.
    """

    def __init__(self, system_prompt: Optional[str] = None):
        self.system_prompt = R1_SYSTEM_PROMPT if system_prompt is None else system_prompt

    def messages(self, question: str) -> List[Message]:
        """Returns the message list for ``question`` (ends with an empty assistant turn)."""
        messages = []
        if self.system_prompt:
            messages.append(Message(role="system", content=self.system_prompt, masked=True))
        messages.append(Message(role="user", content=question, masked=True))
        # Empty, last assistant message: torchtune writes its header but (with end tokens off)
        # no end-of-turn marker, which is exactly a generation prompt.
        messages.append(Message(role="assistant", content="", eot=False))
        return messages

    def __call__(self, tokenizer, question: str) -> Tuple[List[int], str]:
        tokens = tokenize_chat_prompt(tokenizer, self.messages(question))
        return tokens, decode_prompt(tokenizer, tokens)


def make_prompt_formatter(
    prompt_style: Union[str, PromptFormatter] = "r1", system_prompt: Optional[str] = None
) -> PromptFormatter:
    """Returns the formatter for a prompt style.

    Args:
        prompt_style (Union[str, PromptFormatter]): ``"r1"`` (raw template ending with ``<think>``) or
            ``"chat"`` (tokenizer chat format), or a ready formatter callable, returned unchanged.
            Default is ``"r1"``.
        system_prompt (Optional[str]): instruction text. Default is None (:data:`R1_SYSTEM_PROMPT`).

    Returns:
        PromptFormatter: callable ``(tokenizer, question) -> (tokens, prompt_text)``.

    Raises:
        ValueError: for an unknown style name.
    """
    if callable(prompt_style):
        return prompt_style
    if prompt_style == "r1":
        return R1Prompt(system_prompt=system_prompt)
    if prompt_style == "chat":
        return ChatPrompt(system_prompt=system_prompt)
    raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
