"""Tools a policy can call during an episode, and parsing of its tool calls.

A tool is a plain Python function plus a JSON-schema description of its arguments, in the format chat
templates take as ``tools=`` (the OpenAI function format transformers' ``apply_chat_template`` renders)::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {JSON schema}}}

Tool calls use the Hermes convention that Qwen2.5 and Qwen3 are trained on: the model writes

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

anywhere in its turn (several calls allowed). :func:`parse_tool_calls` finds them; :class:`ToolBox` checks
each against its tool's schema and runs it. Every malformed call (unclosed tag, bad JSON, no name, unknown
tool, arguments that do not match the schema, a tool that raises) becomes a :class:`ToolResult` whose
``error`` names the problem: the text goes back to the model as the tool's reply (so it can correct
itself) and the error kind is counted in the metrics; nothing raises into the rollout.
"""

import ast
import importlib
import json
import math
import operator
import re
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import jsonschema

from torchtune_grpo.rewards import run_python_program

__all__ = [
    "TOOL_ERROR_KINDS",
    "Calculator",
    "PythonInterpreter",
    "Tool",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "build_tool",
    "calculate",
    "parse_tool_calls",
]

#: Every ``ToolResult.error_kind`` a call can end with (besides ``""`` for success), for metrics.
TOOL_ERROR_KINDS = (
    "unclosed", "bad_json", "bad_call", "unknown_tool", "bad_arguments", "tool_error", "too_many_calls",
)

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(_OPEN) + r"(.*?)(?:" + re.escape(_CLOSE) + r"|$)", re.DOTALL)


class Tool(NamedTuple):
    """A callable tool.

    Attributes:
        name (str): the name the model calls it by.
        description (str): what it does (rendered into the prompt).
        parameters (Dict[str, Any]): JSON schema of its keyword arguments (``{"type": "object", ...}``).
        fn (Callable[..., Any]): called as ``fn(**arguments)``; its result is sent back as text
            (``str(result)``, or JSON for dicts and lists).
    """

    name: str
    description: str
    parameters: Dict[str, Any]
    fn: Callable[..., Any]

    def schema(self) -> Dict[str, Any]:
        """The tool in the ``tools=`` format of chat templates."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolCall(NamedTuple):
    """One parsed call. ``arguments`` is None when the call could not be parsed (see ``error``)."""

    name: Optional[str]
    arguments: Optional[Dict[str, Any]]
    error_kind: str = ""
    error: str = ""


class ToolResult(NamedTuple):
    """What a call returned (``content``) or why it failed (``error_kind``, and ``content`` explains it).

    Attributes:
        name (Optional[str]): the tool's name, None when the call had none.
        content (str): the text sent back to the model.
        error_kind (str): ``""`` on success, else one of :data:`TOOL_ERROR_KINDS`.
    """

    name: Optional[str]
    content: str
    error_kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.error_kind


def parse_tool_calls(text: str) -> List[ToolCall]:
    """The ``<tool_call>{json}</tool_call>`` blocks of a model turn, in order.

    A block that reaches the end of the text without ``</tool_call>`` counts as a call (``"unclosed"``):
    generation usually stops at the closing tag or at the end of the turn, so an open tag means the model
    ran out of tokens mid-call.

    Args:
        text (str): the decoded assistant turn.

    Returns:
        List[ToolCall]: one per block; an empty list when the turn calls no tool.
    """
    calls = []
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith(_CLOSE):
            calls.append(ToolCall(None, None, "unclosed", f"the tool call has no closing {_CLOSE} tag"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, None, "bad_json", f"the tool call is not valid JSON: {e}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(
                ToolCall(None, None, "bad_call", 'a tool call must be {"name": ..., "arguments": {...}}')
            )
            continue
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                calls.append(ToolCall(obj["name"], None, "bad_json", f"the arguments are not valid JSON: {e}"))
                continue
        if not isinstance(arguments, dict):
            calls.append(ToolCall(obj["name"], None, "bad_arguments", "arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], arguments))
    return calls


def build_tool(spec: Union[Tool, str, Mapping[str, Any]]) -> Tool:
    """A :class:`Tool` from itself, a dotted path of a function returning one, or ``{_component_: path,
    **kwargs}`` (a YAML list entry).

    Raises:
        ValueError: naming the spec, when it does not resolve to a :class:`Tool`.
    """
    if isinstance(spec, Tool):
        return spec
    kwargs: Dict[str, Any] = {}
    if isinstance(spec, Mapping):
        kwargs = {k: v for k, v in spec.items() if k != "_component_"}
        spec = spec.get("_component_")
    if not isinstance(spec, str) or "." not in spec:
        raise ValueError(f"a tool must be a Tool, a dotted path or {{_component_: path, ...}}, got {spec!r}")
    module, _, name = spec.rpartition(".")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"tool {spec!r} cannot be imported: {e}") from None
    try:
        tool = factory(**kwargs)
    except TypeError as e:  # wrong or missing arguments
        raise ValueError(f"tool {spec!r}: {e}") from None
    if not isinstance(tool, Tool):
        raise ValueError(f"tool {spec!r} returned {type(tool).__name__}, not a torchtune_grpo.multiturn.Tool")
    return tool


class ToolBox:
    """A set of tools: their schemas for the prompt, and :meth:`run` for the calls of a model turn.

    Args:
        tools (Sequence[Tool]): the tools; names must be unique.
        max_result_chars (int): longer results are cut to this many characters (and say so), so one call
            cannot flood the context. Default is 2000.

    Raises:
        ValueError: on duplicate names or an invalid parameters schema.
    """

    def __init__(self, tools: Sequence[Tool], max_result_chars: int = 2000) -> None:
        self.tools: Dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"Two tools are named {t.name!r}")
            jsonschema.Draft202012Validator.check_schema(t.parameters)
            self.tools[t.name] = t
        self.max_result_chars = int(max_result_chars)

    def schemas(self) -> List[Dict[str, Any]]:
        """Every tool in the ``tools=`` format of chat templates."""
        return [t.schema() for t in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        """Runs one parsed call; never raises (a failure is a result with ``error_kind``)."""
        if call.error_kind:
            return ToolResult(call.name, f"Error: {call.error}", call.error_kind)
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return ToolResult(call.name, f"Error: unknown tool {call.name!r} (tools: {known})", "unknown_tool")
        try:
            jsonschema.validate(call.arguments, tool.parameters)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "arguments"
            return ToolResult(call.name, f"Error: bad arguments for {call.name} ({where}): {e.message}", "bad_arguments")
        try:
            value = tool.fn(**call.arguments)
        except Exception as e:  # noqa: BLE001 - the model sees the error; the run goes on
            return ToolResult(call.name, f"Error: {type(e).__name__}: {e}", "tool_error")
        text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        if len(text) > self.max_result_chars:
            text = text[: self.max_result_chars] + f"... [cut at {self.max_result_chars} characters]"
        return ToolResult(call.name, text)

    def run(self, text: str) -> List[ToolResult]:
        """Parses the tool calls of a model turn and runs each; an empty list when it calls none."""
        return [self.call(c) for c in parse_tool_calls(text)]


# ------------------------------------------------------------------------------------------ calculator

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION_CHARS = 500
_MAX_EXPONENT = 1000
_MAX_MAGNITUDE = 1e100


def calculate(expression: str) -> Union[int, float]:
    """Evaluates an arithmetic expression: numbers, ``+ - * / // % **``, unary signs, parentheses.

    The expression is parsed with :mod:`ast` and only those nodes are evaluated (no names, calls or
    attributes: nothing a model writes can run code). Exponents above 1000 and results above 1e100 in
    magnitude are refused, so a call cannot hang the trainer on ``9**9**9``.

    Args:
        expression (str): e.g. ``"(17 + 3) * 4 / 5"``.

    Returns:
        Union[int, float]: the value; an integral float (``6 / 3``) comes back as an int.

    Raises:
        ValueError: on anything that is not such an expression, or a value out of range.
        ZeroDivisionError: on division by zero.
    """
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def ev(node: ast.AST) -> Union[int, float]:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {_MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, complex) or abs(value) > _MAX_MAGNITUDE:
                raise ValueError("result out of range")
            return value
        raise ValueError(f"unsupported element {type(node).__name__!s}: use numbers and + - * / // % ** ( )")

    value = ev(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("result out of range")
        if value.is_integer():
            return int(value)
        return float(f"{value:.12g}")
    return value


def Calculator(name: str = "calculator") -> Tool:  # noqa: N802 - a YAML `_component_` reads like a class
    """The built-in calculator tool (:func:`calculate`), for ``tools:`` in a config."""
    return Tool(
        name=name,
        description="Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (17 + 3) * 4"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=calculate,
    )


# ------------------------------------------------------------------------------------------------ python


def PythonInterpreter(  # noqa: N802 - a YAML `_component_` reads like a class
    name: str = "python",
    time_limit: float = 5.0,
    memory_limit_mb: int = 512,
    max_output_chars: int = 2000,
    network: str = "auto",
) -> Tool:
    """The built-in Python tool: runs the model's program in the code-execution sandbox
    (:func:`~torchtune_grpo.rewards.run_python_program`: fresh interpreter, wall-clock/CPU/memory limits, no
    network, no processes, a throwaway directory) and returns what it printed, then the uncaught error if any.

    Args:
        name (str): the tool's name. Default is ``"python"``.
        time_limit (float): seconds per program. Default is 5.0.
        memory_limit_mb (int): address-space limit. Default is 512.
        max_output_chars (int): printed characters kept. Default is 2000.
        network (str): the sandbox's network mode (``auto``, ``namespace``, ``audit``). Default is ``auto``.
    """

    def run(code: str) -> str:
        result = run_python_program(
            code, time_limit=time_limit, memory_limit_mb=memory_limit_mb, max_output_chars=max_output_chars,
            network=network,
        )
        text = result.stdout + (f"... [output cut at {max_output_chars} characters]" if result.cut else "")
        if result.error:
            text += ("\n" if text and not text.endswith("\n") else "") + f"Error: {result.error}"
        return text if text else "(no output)"

    return Tool(
        name=name,
        description="Run a Python program and return what it prints (use print). No network, no files kept.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the Python program"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        fn=run,
    )
