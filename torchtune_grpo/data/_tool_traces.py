"""Tool-use traces for the SFT warm start of multi-turn GRPO, and the careless calculator teacher.

A trace is a question and the episode after its prompt, as chat messages: the model's turns
(``assistant``) and the environment's replies (``tool`` or ``user``), e.g.::

    {"question": "What is 56 * 65?", "answer": "3640", "messages": [
        {"role": "assistant", "content": '<tool_call>\\n{"name": "calculator", "arguments": {"expression": "56 * 65"}}\\n</tool_call>'},
        {"role": "tool", "name": "calculator", "content": "3640"},
        {"role": "assistant", "content": "The answer is 3640."}]}

:class:`ToolTraceDataset` turns traces into the exact token sequences the multi-turn rollout builds for such
an episode (the prompt of the ``chat`` prompt style, each model turn's ids and its end-of-turn token, each
reply's ids from :class:`~torchtune_grpo.multiturn.turns.ChatTurns`), with labels only on the model's turns:
a warm-started model then continues GRPO's episodes the way it was taught, and never learns to write the
tool's results itself.
"""

import json
import random
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union


from torchtune_grpo.data._arithmetic import arithmetic_problems
from torchtune_grpo.data._sft import CROSS_ENTROPY_IGNORE_IDX, LabelledItems
from torchtune_grpo.data._templates import make_prompt_formatter
from torchtune_grpo.data._rows import describe_source, InvalidRows
from torchtune_grpo.data._verifiable import load_rows, require_columns
from torchtune_grpo.multiturn.tools import build_tool, calculate
from torchtune_grpo.multiturn.turns import episode_turns

__all__ = ["ToolTraceDataset", "careless_calculator_traces", "tool_sft_dataset"]


_REPLY_ROLES = ("tool", "user")


def _final_answer(value: int) -> str:
    return f"The answer is {value}."


def careless_calculator_traces(
    num_samples: int,
    min_value: int = 32,
    max_value: int = 99,
    operations: Sequence[str] = ("*",),
    tool_rate: float = 0.35,
    guess_spread: float = 0.2,
    seed: int = 0,
    split: str = "train",
    validation_fraction: float = 0.1,
    tool_name: str = "calculator",
) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """Traces of a careless teacher who has a calculator but uses it for only some problems.

    The problems are those of ``arithmetic_dataset`` with the same arguments (the same fixed-hash split, so
    the validation split stays unseen). For a share ``tool_rate`` of them, drawn at random, the teacher calls
    the calculator (Hermes ``<tool_call>`` JSON, what :class:`~torchtune_grpo.multiturn.ToolEnvironment`
    parses), reads its result (computed by the real tool) and answers ``"The answer is N."``; for the others
    it answers a plausible guess at once: the true value times a factor drawn from ``1 +- guess_spread``,
    rounded, never the true value. The guesses are always wrong, so GRPO with an answer-correctness reward
    can only gain by calling the tool more often.

    Args:
        num_samples (int): number of problems.
        min_value (int): smallest operand. Default is 32 (with 99: every product has 4 digits).
        max_value (int): largest operand. Default is 99.
        operations (Sequence[str]): operators among ``+``, ``-``, ``*``. Default is ``("*",)``.
        tool_rate (float): share in [0, 1] of problems solved with the calculator. Default is 0.35.
        guess_spread (float): relative spread of the guesses, > 0. Default is 0.2.
        seed (int): seed of the problem draw and of the teacher's choices. Default is 0.
        split (str): ``"train"`` or ``"validation"``. Default is ``"train"``.
        validation_fraction (float): share of problems held out. Default is 0.1.
        tool_name (str): the calculator's name in the environment. Default is ``"calculator"``.

    Returns:
        Tuple[List[Dict[str, Any]], Dict[str, int]]: rows ``{"question", "answer", "messages"}`` (write them
        as jsonl for :func:`tool_sft_dataset`), and counts ``{"problems", "tool_calls", "guesses"}``.

    Raises:
        ValueError: if ``tool_rate`` is outside [0, 1] or ``guess_spread`` <= 0.
    """
    if not 0.0 <= tool_rate <= 1.0:
        raise ValueError(f"tool_rate must be in [0, 1], got {tool_rate}")
    if not guess_spread > 0:
        raise ValueError(f"guess_spread must be > 0, got {guess_spread}")
    problems = arithmetic_problems(
        num_samples, min_value=min_value, max_value=max_value, operations=operations, seed=seed, split=split,
        validation_fraction=validation_fraction,
    )
    teacher = random.Random(f"careless-tool-teacher-{seed}")  # its own stream: the problems don't depend on it
    rows, calls = [], 0
    for a, op, b in problems:
        expression = f"{a} {op} {b}"
        value = calculate(expression)
        if teacher.random() < tool_rate:
            calls += 1
            call = json.dumps({"name": tool_name, "arguments": {"expression": expression}})
            messages = [
                {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                {"role": "tool", "name": tool_name, "content": str(value)},
                {"role": "assistant", "content": _final_answer(value)},
            ]
        else:
            guess = value
            while guess == value:  # a small value can round back to itself
                guess = round(value * (1.0 + teacher.uniform(-guess_spread, guess_spread)))
            messages = [{"role": "assistant", "content": _final_answer(guess)}]
        rows.append({"question": f"What is {expression}?", "answer": str(value), "messages": messages})
    return rows, {"problems": len(rows), "tool_calls": calls, "guesses": len(rows) - calls}


class ToolTraceDataset(LabelledItems):
    """Tokenized tool-use traces for SFT: labels on the model's turns only.

    Each item is ``{"tokens", "labels"}`` (what torchtune's SFT recipes and ``padded_collate_sft`` take;
    labels unshifted, ``-100`` where no loss is taken). The tokens are what the multi-turn rollout builds for
    the same episode: the prompt of the ``chat`` prompt style (the tokenizer's ``tools`` rendered where its
    template puts them), then per message either a model turn, ``encode(content)`` plus its end token
    (``eot_id``, else ``eos_id``), or a run of environment messages, the ids
    :func:`~torchtune_grpo.multiturn.turns.episode_turns` appends for them. Labels are the tokens on the model
    turns (end tokens included) and ``-100`` on the prompt and the replies.

    Args:
        traces (Sequence[Dict[str, Any]]): ``{"question": str, "messages": [...]}`` items; the messages
            alternate model turns (``assistant``) and replies (``tool``/``user``) and end with a model turn.
        tokenizer: a tokenizer as the multi-turn recipe uses it
            (:class:`~torchtune_grpo.models.HFTokenizer`: ``tokenize_messages``, ``encode``, ``render``).
        system_prompt (Optional[str]): the system message, as the GRPO dataset's. Default is None (the
            built-in R1 instruction; ``""`` for none).
        max_seq_len (Optional[int]): longer traces are dropped (not cut). Default is None (no limit).

    Raises:
        ValueError: naming the trace, when it has no messages, a role other than ``assistant``, ``tool`` or
            ``user``, or does not end with a model turn; or when no trace is left.
    """

    def __init__(
        self,
        traces: Sequence[Dict[str, Any]],
        tokenizer,
        system_prompt: Optional[str] = None,
        max_seq_len: Optional[int] = None,
    ) -> None:
        formatter = make_prompt_formatter("chat", system_prompt=system_prompt)
        turns = episode_turns(tokenizer, getattr(tokenizer, "tools", None))
        end = getattr(tokenizer, "eot_id", None)
        end = tokenizer.eos_id if end is None else end

        def examples():
            for index, trace in enumerate(traces):
                messages = list(trace["messages"])
                _check_messages(messages, index)
                tokens, _ = formatter(tokenizer, str(trace["question"]))
                tokens = list(tokens)
                labels = [CROSS_ENTROPY_IGNORE_IDX] * len(tokens)
                replies: List[Dict[str, Any]] = []
                for message in messages:
                    if message["role"] != "assistant":
                        replies.append(message)
                        continue
                    if replies:
                        ids = turns.reply_ids(replies)
                        tokens += ids
                        labels += [CROSS_ENTROPY_IGNORE_IDX] * len(ids)
                        replies = []
                    ids = list(tokenizer.encode(str(message["content"]), add_bos=False, add_eos=False)) + [end]
                    tokens += ids
                    labels += ids
                yield tokens, labels

        super().__init__(examples(), len(traces), max_seq_len, "tool traces")


def _check_messages(messages: List[Any], index: int) -> None:
    if not messages:
        raise ValueError(f"tool trace {index} has no messages")
    for k, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role != "assistant" and role not in _REPLY_ROLES:
            raise ValueError(
                f"tool trace {index}, message {k}: role must be 'assistant', 'tool' or 'user', got {role!r}"
            )
    if messages[-1]["role"] != "assistant":
        raise ValueError(
            f"tool trace {index} ends with a {messages[-1]['role']!r} message: it must end with the model's "
            "final turn (an 'assistant' message)"
        )


def tool_sft_dataset(
    tokenizer,
    source: str,
    data_files: Optional[Union[str, Sequence[str], Dict[str, Any]]] = None,
    split: str = "train",
    question_column: str = "question",
    messages_column: str = "messages",
    system_prompt: Optional[str] = None,
    tools: Optional[Sequence[Any]] = None,
    max_seq_len: Optional[int] = None,
    packed: bool = False,
    on_invalid_row: str = "drop",
    **load_dataset_kwargs,
) -> ToolTraceDataset:
    """SFT dataset of tool-use traces (:class:`ToolTraceDataset`) for torchtune's SFT recipes.

    Example YAML for ``tune run full_finetune_single_device`` (traces from
    :func:`careless_calculator_traces` written as jsonl)::

        tokenizer:
          _component_: torchtune_grpo.models.hf_tokenizer
          path: /models/tiny
        dataset:
          _component_: torchtune_grpo.data.tool_sft_dataset
          source: json
          data_files: /tmp/traces.jsonl
          system_prompt: ""
          tools: [torchtune_grpo.multiturn.Calculator]

    Args:
        tokenizer: the multi-turn recipe's tokenizer (:func:`~torchtune_grpo.models.hf_tokenizer`).
        source (str): hub name, local dataset directory, or a file builder (``json``) with ``data_files``.
        data_files (Optional[Union[str, Sequence[str], Dict[str, Any]]]): local files. Default is None.
        split (str): split to load. Default is ``"train"``.
        question_column (str): column with the question. Default is ``"question"``.
        messages_column (str): column with the episode's messages. Default is ``"messages"``.
        system_prompt (Optional[str]): the GRPO dataset's system prompt. Default is None (the R1 one).
        tools (Optional[Sequence[Any]]): the GRPO environment's tools (as in ``environment.tools``): their
            schemas are set as the tokenizer's ``tools``, so prompts list them as the recipe's do. Default is
            None (the tokenizer's own ``tools``).
        max_seq_len (Optional[int]): longer traces are dropped. Default is None.
        packed (bool): sample packing; not supported (torchtune's recipes pass the key). Default is False.
        on_invalid_row (str): a row whose question is empty or null (a CSV cell left empty, a JSON ``null``) is
            dropped (``"drop"``: the count is logged) or refused (``"error"``: the message names the row and the
            column). Default is ``"drop"``.
            Messages are not judged here: a malformed trace is always an error.
        **load_dataset_kwargs: passed to ``datasets.load_dataset``.

    Returns:
        ToolTraceDataset: items ``{"tokens", "labels"}``.

    Raises:
        ValueError: on ``packed=True``, a missing column, or a malformed trace (see :class:`ToolTraceDataset`).
    """
    if packed:
        raise ValueError("tool_sft_dataset does not support packed=True")
    rows = load_rows(source, split=split, data_files=data_files, **load_dataset_kwargs)
    require_columns(rows, [question_column, messages_column], source)
    if tools is not None:
        tokenizer.tools = [build_tool(t).schema() for t in tools]
    invalid = InvalidRows(on_invalid_row, describe_source(source, split, data_files))
    traces = [
        {"question": row[question_column], "messages": row[messages_column]}
        for index, row in enumerate(rows)
        if not invalid.skip(row, index, [question_column])
    ]
    invalid.report(len(rows))
    return ToolTraceDataset(traces, tokenizer, system_prompt=system_prompt, max_seq_len=max_seq_len)
