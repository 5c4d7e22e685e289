"""Token ids of what the environment says between the model's turns.

An episode is one token sequence: the prompt, the model's first turn (ending with its end-of-turn token),
the environment's reply, the model's next turn, and so on. The history is never re-tokenized: the model's
turns are exactly the tokens it sampled, and each reply is appended as the ids of the text the chat
template writes after an assistant turn: for Qwen2.5/Qwen3 (Hermes style) tool results become

    \\n<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n

The text is found by rendering a probe conversation (a user message, an assistant message with a marker,
then the replies) with the generation prompt and taking what follows the marker and the end-of-turn token,
so whatever the template does with ``tool`` messages is what the model sees. Models without a chat template
use :class:`PlainTurns`.
"""

from typing import Any, Dict, List, Optional, Sequence

__all__ = ["ChatTurns", "PlainTurns", "episode_turns"]

_PROBE = "\u2063probe-assistant-turn\u2063"  # invisible separators: never part of a real template's text


class ChatTurns:
    """Environment replies rendered by the model's own chat template.

    Args:
        tokenizer: a tokenizer with a chat template (:class:`~torchtune_grpo.models.HFTokenizer`):
            ``render(messages, add_generation_prompt, tools)``, ``encode_text``, ``decode`` and ``eot_id``.
        tools (Optional[List[Dict[str, Any]]]): the tool schemas the prompt was rendered with (some templates
            render tool results differently when tools are declared). Default is None.

    Raises:
        ValueError: when the template does not close an assistant turn with ``eot_id`` (the reply could not
            be joined to the model's tokens).
    """

    def __init__(self, tokenizer, tools: Optional[List[Dict[str, Any]]] = None) -> None:
        if getattr(tokenizer, "eot_id", None) is None:
            raise ValueError(
                "multi-turn chat episodes need the tokenizer's end-of-turn token (eot_id); this tokenizer has "
                "none: use a model directory with a chat template (torchtune_grpo.models.hf_tokenizer) or the "
                "plain protocol (PlainTurns)"
            )
        self.tokenizer = tokenizer
        self.tools = tools
        self.eot_id = int(tokenizer.eot_id)
        self._eot_text = tokenizer.decode([self.eot_id], skip_special_tokens=False)
        self.reply_ids([{"role": "tool", "content": "probe"}])  # fail at setup, not mid-rollout

    def prompt_ids(self, messages: List[Dict[str, Any]]) -> List[int]:
        """The first prompt of an episode: ``messages`` with the tools and the generation prompt."""
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=self.tools)

    def reply_ids(self, replies: Sequence[Dict[str, Any]]) -> List[int]:
        """Ids to append after a model turn that ended with ``eot_id``: the replies, then the header of the
        model's next turn.

        Args:
            replies (Sequence[Dict[str, Any]]): the environment's messages (``role`` ``tool`` or ``user``).

        Returns:
            List[int]: the ids; their text is exactly what the template writes after the end-of-turn token.
        """
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _PROBE}, *replies]
        text = self.tokenizer.render(probe, add_generation_prompt=True, tools=self.tools)
        end = text.rfind(_PROBE) + len(_PROBE)
        if end < len(_PROBE) or not text.startswith(self._eot_text, end):
            raise ValueError(
                f"the chat template does not end an assistant turn with {self._eot_text!r} (its end-of-turn "
                "token), so environment replies cannot be appended to the model's tokens"
            )
        return self.tokenizer.encode_text(text[end + len(self._eot_text):])


class PlainTurns:
    """Environment replies as plain text, for models without a chat template.

    Each reply is ``<tool_response>\\n{content}\\n</tool_response>\\n`` (tool results) or its content
    (``user`` messages) on a new line, and the model continues right after it.

    Args:
        tokenizer: ``encode(text, add_bos, add_eos)``.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def reply_ids(self, replies: Sequence[Dict[str, Any]]) -> List[int]:
        """Ids of the replies' text (see the class docstring)."""
        parts = []
        for m in replies:
            content = str(m.get("content", ""))
            parts.append(f"<tool_response>\n{content}\n</tool_response>\n" if m["role"] == "tool" else content + "\n")
        return self.tokenizer.encode("\n" + "".join(parts), add_bos=False, add_eos=False)


def episode_turns(tokenizer, tools: Optional[List[Dict[str, Any]]] = None):
    """:class:`ChatTurns` for a tokenizer with a chat template and an end-of-turn token, else
    :class:`PlainTurns`: how the rollout (and SFT on tool traces) joins replies to the model's turns.

    Args:
        tokenizer: the policy's tokenizer.
        tools (Optional[List[Dict[str, Any]]]): the tool schemas the prompts are rendered with. Default is None.
    """
    chat = getattr(tokenizer, "chat_template", None) is not None and getattr(tokenizer, "eot_id", None) is not None
    return ChatTurns(tokenizer, tools) if chat else PlainTurns(tokenizer)
