"""A Hugging Face model directory's own tokenizer: ``tokenizer.json`` for the ids, its chat template for chat
prompts, and its stop tokens, behind the interface the datasets, rewards, engines and evaluation use from
torchtune's tokenizers (``encode``, ``decode``, ``tokenize_messages``, ``pad_id``, ``eos_id``, ``stop_tokens``).
"""

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tokenizers import Tokenizer

from torchtune_grpo.models._chat_template import ChatTemplate, ChatTemplateError, read_chat_template

__all__ = ["HFTokenizer", "hf_tokenizer"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_PROBE = "PROBE_ASSISTANT_TEXT"


def _read_json(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: Any) -> Optional[str]:
    """``"<|im_end|>"`` or ``{"content": "<|im_end|>", ...}`` (a serialised AddedToken) -> the text."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> List[int]:
    """``eos_token_id`` as config files write it: an int, a list of ints, or null."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class HFTokenizer:
    """The tokenizer and chat template of a Hugging Face model directory.

    Args:
        path (str): the model directory: ``tokenizer.json`` (required), ``tokenizer_config.json``,
            ``special_tokens_map.json``, ``chat_template.jinja``, ``generation_config.json``, ``config.json``
            (each optional).
        enable_thinking (Optional[bool]): passed to the chat template (Qwen3: False adds an empty
            ``<think></think>`` block to the prompt, so the model answers without reasoning). Default is None
            (the template's default; Qwen3 thinks).
        chat_template_kwargs (Optional[Dict[str, Any]]): further chat template variables. Default is None.

    Attributes:
        bos_id (Optional[int]): the beginning-of-text token (None when the model has none).
        eos_id (int): the end-of-text token (``eos_token`` of ``tokenizer_config.json``).
        eot_id (Optional[int]): the token the chat template closes an assistant turn with (``<|im_end|>``,
            ``<|eot_id|>``); None without a chat template.
        pad_id (int): padding (``pad_token``, else ``eos_id``); only ever a filler under a mask.
        stop_tokens (List[int]): generation stops on any of these: ``eos_token_id`` of
            ``generation_config.json`` and ``config.json`` (ints or lists), ``eos_id`` and ``eot_id``.
        tools (Optional[List[Dict[str, Any]]]): tool schemas rendered into every generation prompt that
            :meth:`tokenize_messages` builds (set by the recipe from a multi-turn environment's tools, before
            the datasets tokenize their prompts). Default is None.

    Raises:
        FileNotFoundError: without ``tokenizer.json``.
    """

    def __init__(
        self,
        path: str,
        enable_thinking: Optional[bool] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
    ) -> None:
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{directory} has no tokenizer.json (the fast-tokenizer file every current Hugging Face model "
                "ships; `tune download` fetches it)"
            )
        self.path = str(directory)
        self._tok = Tokenizer.from_file(str(tokenizer_file))
        config = {**_read_json(directory / "special_tokens_map.json"), **_read_json(directory / "tokenizer_config.json")}
        self.special_tokens: Dict[str, Any] = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        extra = config.get("additional_special_tokens")
        if extra:
            self.special_tokens["additional_special_tokens"] = [_token_text(t) for t in extra]

        self.bos_id = self._special_id("bos_token")
        eos = self._special_id("eos_token")
        model_config = _read_json(directory / "config.json")
        generation = _read_json(directory / "generation_config.json")
        fallback_eos = _ids(generation.get("eos_token_id")) + _ids(model_config.get("eos_token_id"))
        if eos is None and not fallback_eos:
            raise ValueError(f"{directory}: no eos_token in tokenizer_config.json and no eos_token_id in "
                             "generation_config.json or config.json: generation would never stop")
        self.eos_id: int = eos if eos is not None else fallback_eos[0]
        pad = self._special_id("pad_token")
        self.pad_id: int = pad if pad is not None else (_ids(generation.get("pad_token_id")) or [self.eos_id])[0]
        self._add_bos = self._adds_bos(config)

        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
        source = read_chat_template(directory, config)
        self.chat_template: Optional[ChatTemplate] = (
            None if source is None else ChatTemplate(source, self.special_tokens, kwargs)
        )
        self.eot_id: Optional[int] = self._end_of_turn()
        stops = fallback_eos + [self.eos_id] + ([self.eot_id] if self.eot_id is not None else [])
        self.stop_tokens: List[int] = sorted(set(stops))
        self.tools: Optional[List[Dict[str, Any]]] = None

    # ------------------------------------------------------------------------------------------ ids

    def _special_id(self, key: str) -> Optional[int]:
        text = self.special_tokens.get(key)
        return None if text is None else self._tok.token_to_id(text)

    def _adds_bos(self, config: Mapping[str, Any]) -> bool:
        """Whether the model's tokenizer starts a text with BOS (``add_bos_token``, else what
        ``tokenizer.json``'s post-processor does): Llama 3 does, Qwen has no BOS."""
        if self.bos_id is None:
            return False
        if "add_bos_token" in config:
            return bool(config["add_bos_token"])
        return self._tok.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id]

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows (added tokens included); the model's embedding may have more rows."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> List[int]:
        """Token ids of ``text``.

        Args:
            text (str): any text; special-token strings in it (``<|im_start|>``) become their ids.
            add_bos (bool): start with BOS if the model's tokenizer does (see :attr:`bos_id`). Default is True.
            add_eos (bool): end with :attr:`eos_id`. Default is True.

        Returns:
            List[int]: the ids.
        """
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self._add_bos:
            ids = [self.bos_id] + ids
        if add_eos:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; special tokens (``<|im_end|>``) dropped when ``skip_special_tokens``."""
        return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------------------ chat

    def _require_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise ChatTemplateError(
                f"{self.path} has no chat template (neither chat_template.jinja nor 'chat_template' in "
                "tokenizer_config.json), so chat prompts (prompt_style: chat) cannot be built: a base model has "
                "no chat format. Use prompt_style: r1, or an instruct model's directory."
            )
        return self.chat_template

    def render(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[List[Dict[str, Any]]] = None,
    ) -> str:
        """The chat template applied to ``messages`` (``[{"role": ..., "content": ...}]``), as text;
        ``tools``: JSON schemas of callable tools, rendered where the template puts them. Default is None."""
        return self._require_template().render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    def apply_chat_template(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[List[Dict[str, Any]]] = None,
    ) -> List[int]:
        """Token ids of :meth:`render`: what ``transformers``' ``apply_chat_template(messages,
        add_generation_prompt=..., tools=...)`` returns (the template writes BOS itself where the model has
        one)."""
        return self._tok.encode(self.render(messages, add_generation_prompt, tools), add_special_tokens=False).ids

    def encode_text(self, text: str) -> List[int]:
        """Token ids of ``text`` as a chat template's output is encoded (special-token strings become their
        ids; no BOS or EOS added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_messages(self, messages: Sequence[Any], add_eos: bool = False) -> Tuple[List[int], List[bool]]:
        """A generation prompt from torchtune ``Message`` objects (or role/content dicts), as the chat datasets
        build them: the conversation followed by an empty assistant message.

        Args:
            messages (Sequence[Any]): system/user messages, then an empty assistant message.
            add_eos (bool): must be False: a generation prompt ends with the assistant's header. Default is
                False.

        Returns:
            Tuple[List[int], List[bool]]: the ids and a mask (True everywhere: no prompt token is trained on).

        Raises:
            ChatTemplateError: without a chat template.
            ValueError: when the last message is not an empty assistant message, or ``add_eos`` is True.
        """
        dicts = [_as_dict(m) for m in messages]
        if not dicts or dicts[-1]["role"] != "assistant" or dicts[-1]["content"] or add_eos:
            raise ValueError(
                "HFTokenizer.tokenize_messages builds generation prompts only: the conversation must end with an "
                "empty assistant message and add_eos must be False"
            )
        tokens = self.apply_chat_template(dicts[:-1], add_generation_prompt=True, tools=self.tools)
        return tokens, [True] * len(tokens)

    def _end_of_turn(self) -> Optional[int]:
        """The special token the template writes right after an assistant message's text."""
        if self.chat_template is None:
            return None
        try:
            text = self.chat_template.render(
                [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                add_generation_prompt=False,
            )
        except ChatTemplateError:
            return None
        tail = text[text.rfind(_PROBE) + len(_PROBE):]
        ids = self._tok.encode(tail, add_special_tokens=False).ids
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        if ids and self._tok.id_to_token(ids[0]) in specials:
            return ids[0]
        return None


def _as_dict(message: Any) -> Dict[str, Any]:
    if isinstance(message, Mapping):
        return {"role": message["role"], "content": message.get("content", "")}
    return {"role": message.role, "content": message.text_content}


def hf_tokenizer(
    path: str, enable_thinking: Optional[bool] = None, chat_template_kwargs: Optional[Dict[str, Any]] = None
) -> HFTokenizer:
    """The tokenizer of a Hugging Face model directory (see :class:`HFTokenizer`)."""
    return HFTokenizer(path, enable_thinking=enable_thinking, chat_template_kwargs=chat_template_kwargs)
