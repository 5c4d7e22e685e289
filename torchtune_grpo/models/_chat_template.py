"""A model's own chat template, rendered as transformers' ``apply_chat_template`` renders it.

The template is Jinja code shipped with the model (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``). transformers compiles it in a sandboxed environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, and two
globals (``raise_exception``, ``strftime_now``), then renders it with the messages, ``add_generation_prompt``,
the special tokens (``bos_token``, ``eos_token``, ...) and any extra keyword (Qwen3's ``enable_thinking``).
Doing the same here gives the same text, hence the same token ids.
"""

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "read_chat_template"]


class ChatTemplateError(ValueError):
    """A chat template is missing, ambiguous, or raised while rendering (its own message included)."""


class _GenerationBlock(Extension):
    """``{% generation %} ... {% endgeneration %}`` (marks assistant text for transformers' masks): rendered as
    its body, which is all transformers does with it when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def read_chat_template(directory: Union[str, Path], tokenizer_config: Mapping[str, Any]) -> Optional[str]:
    """The chat template of a model directory, or None when it has none.

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template`` (as in transformers). A list
    of named templates gives the one named ``default``.

    Raises:
        ChatTemplateError: for a list of named templates without ``default``.
    """
    path = Path(directory) / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named:
            raise ChatTemplateError(
                f"{directory}/tokenizer_config.json has named chat templates {sorted(named)} and no 'default'"
            )
        template = named["default"]
    return template or None


class ChatTemplate:
    """A compiled chat template.

    Args:
        source (str): the Jinja template.
        special_tokens (Mapping[str, Any]): ``bos_token``, ``eos_token``, ... as the template sees them.
        kwargs (Optional[Mapping[str, Any]]): extra template variables (e.g. ``enable_thinking``). Default is
            None.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, Any], kwargs: Optional[Mapping[str, Any]] = None):
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self._template = env.from_string(source)
        # transformers: the special tokens first, so that explicit keywords override them
        self._variables: Dict[str, Any] = {**special_tokens, **(kwargs or {})}

    def render(
        self,
        messages: List[Dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Optional[List[Dict[str, Any]]] = None,
    ) -> str:
        """The conversation as text, ending with the assistant's header when ``add_generation_prompt``.

        ``tools`` (JSON schemas, as transformers' ``apply_chat_template(tools=...)`` takes them) are rendered
        where the template puts them (Qwen2.5/Qwen3: a ``<tools>`` block in the system message).

        Raises:
            ChatTemplateError: when the template raises (e.g. roles out of order), with its message.
        """
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"the model's chat template refused the conversation: {err}") from err
