"""Prompt formats: how a question becomes the token ids that generation continues from.

Two styles are provided:

- ``"r1"``: a raw-text template (no chat special tokens) that instructs the model to reason inside
  ``<think> </think>`` and answer inside ``<answer> </answer>``, and that ends with an opening
  ``<think>`` so the model starts reasoning right away. Suited to base models.
- ``"chat"``: the tokenizer's own chat format (``tokenize_messages``) with an optional system
  message, ending with the assistant header and no end-of-turn token. Suited to instruct models.

A formatter is any callable ``formatter(tokenizer, question) -> (tokens, prompt_text)``.
"""

from typing import Callable, List, Optional, Tuple, Union

from torchtune.data import Message

from torchtune_grpo.models.chat_prompts import decode_prompt, tokenize_chat_prompt

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
