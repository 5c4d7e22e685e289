"""Text formats that datasets and rewards share: answers, code test cases, chat prompts.

Datasets and rewards read the same formats: a math dataset extracts its gold answer with the same
:func:`extract_answer` the rewards use on completions, a code dataset checks its test cases with the
:func:`normalize_tests` the execution reward runs, and a model judge builds its prompt with the
:func:`tokenize_chat_prompt` the chat prompt style uses. They live here, imported by both
:mod:`torchtune_grpo.data` and :mod:`torchtune_grpo.rewards` (which re-export them), so that neither
package reaches into the other's private modules.
"""

import inspect
import json
import re
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from torchtune.data import Message

__all__ = [
    "EXTRACT_MODES",
    "decode_prompt",
    "extract_answer",
    "normalize_tests",
    "to_plain",
    "tokenize_chat_prompt",
]

#: Valid ``extract`` modes of :func:`extract_answer` (and of the rewards that extract answers).
EXTRACT_MODES = ("answer_tag", "boxed", "last_number")

_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"
# `\boxed{`, `\fbox{` openings and plain braces, so one left-to-right pass can match braces with a stack.
_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
# The last number of a text: integers (optionally with 3-digit comma groups), decimals and simple
# fractions. `\d` is Unicode-aware here on purpose (see the module docstring). The look-behind stops a
# match from starting inside a word or after a digit, so "5-3" ends with "3", not "-3", and "x2" has none.
_LAST_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")


def to_plain(value: Any) -> Any:
    """Converts OmegaConf containers (what YAML arguments arrive as) to plain dicts and lists."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def extract_answer(text: str, mode: str = "answer_tag") -> Optional[str]:
    """Extracts the final answer from a completion.

    Args:
        text (str): the completion.
        mode (str): one of :data:`EXTRACT_MODES`. Default is ``"answer_tag"``.

            - ``"answer_tag"``: the content of the last ``<answer>...</answer>`` block; None when that
              content holds another ``</answer>`` (nested tags).
            - ``"boxed"``: the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), with
              nested braces balanced (``\\boxed{\\frac{3}{4}}`` gives ``\\frac{3}{4}``).
            - ``"last_number"``: the last number in the text (integer, decimal with optional ``1,000``
              grouping, or simple fraction ``a/b``; a leading minus when it is not a subtraction).

    Returns:
        Optional[str]: the extracted answer (not stripped), or None when there is none.

    Raises:
        ValueError: if ``mode`` is unknown.
    """
    if mode == "answer_tag":
        end = text.rfind(_ANSWER_CLOSE)
        if end < 0:
            return None
        start = text.rfind(_ANSWER_OPEN, 0, end)
        if start < 0:
            return None
        inner = text[start + len(_ANSWER_OPEN) : end]
        # Nested or garbled tags ("<answer><answer>4</answer></answer>") leave a tag inside: no answer.
        if _ANSWER_CLOSE in inner:
            return None
        return inner
    if mode == "boxed":
        # Stack of (is_box, content_start); a closing brace pops one level. The answer is the box that
        # closes last. Stray closing braces (empty stack) are ignored. One pass, linear in len(text).
        stack: List[tuple] = []
        found: Optional[str] = None
        for m in _BOX_TOKEN.finditer(text):
            tok = m.group()
            if tok == "}":
                if stack:
                    is_box, start = stack.pop()
                    if is_box:
                        found = text[start : m.start()]
            elif tok == "{":
                stack.append((False, 0))
            else:
                stack.append((True, m.end()))
        return found
    if mode == "last_number":
        last = None
        for last in _LAST_NUMBER.finditer(text):
            pass
        return None if last is None else last.group()
    raise ValueError(f"unknown extract mode {mode!r}; valid modes are {list(EXTRACT_MODES)}")


def normalize_tests(tests: Any) -> List[Dict[str, str]]:
    """Turns a dataset's test cases into the runner's list of tests.

    Accepted shapes:

    - a list of Python statements (``["assert add(1, 2) == 3", ...]``, MBPP/HumanEval style): each runs
      after the solution, in the solution's namespace; it passes when it raises nothing;
    - a list of ``{"input": str, "output": str}`` (stdin/stdout, APPS/CodeContests style): the solution
      runs as ``__main__`` with that stdin; it passes when its stdout equals ``output`` (trailing
      whitespace of each line and surrounding blank lines ignored);
    - ``{"inputs": [...], "outputs": [...]}``: the same, column-wise;
    - a JSON string of any of the above, or any other string: one test script.

    Args:
        tests (Any): the dataset value.

    Returns:
        List[Dict[str, str]]: ``{"kind": "assert", "source": ...}`` or ``{"kind": "io", "input": ...,
        "output": ...}`` items.

    Raises:
        ValueError: on an empty or unrecognised value.
    """
    tests = to_plain(tests)
    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped[:1] in ("[", "{"):
            try:
                return normalize_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        if not stripped:
            raise ValueError("empty test cases")
        return [{"kind": "assert", "source": tests}]
    if isinstance(tests, dict):
        if "inputs" in tests and "outputs" in tests:
            ins, outs = list(tests["inputs"]), list(tests["outputs"])
            if len(ins) != len(outs):
                raise ValueError(f"{len(ins)} inputs but {len(outs)} outputs in test cases")
            tests = [{"input": i, "output": o} for i, o in zip(ins, outs)]
        elif "input" in tests and "output" in tests:
            tests = [tests]
        else:
            raise ValueError(f"test cases dict needs inputs/outputs, got keys {sorted(tests)}")
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"test cases must be a non-empty list, got {type(tests).__name__}: {str(tests)[:100]!r}")
    out = []
    for t in tests:
        if isinstance(t, str):
            out.append({"kind": "assert", "source": t})
        elif isinstance(t, dict) and t.get("kind") == "assert" and isinstance(t.get("source"), str):
            out.append({"kind": "assert", "source": t["source"]})  # already normalised
        elif isinstance(t, dict) and "input" in t and "output" in t:
            out.append({"kind": "io", "input": _io_text(t["input"]), "output": _io_text(t["output"])})
        else:
            raise ValueError(f"unrecognised test case {str(t)[:100]!r}: expected a statement or {{input, output}}")
    return out


def _io_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return str(value)


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
