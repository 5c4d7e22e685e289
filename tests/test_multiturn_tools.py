"""Tool-call parsing, the calculator, the tool box and the environment runner (torchtune_grpo/multiturn)."""

import asyncio
import json
import threading

import pytest

from torchtune_grpo.multiturn import (
    Calculator,
    EnvReply,
    Environment,
    PythonInterpreter,
    Tool,
    ToolBox,
    ToolEnvironment,
    calculate,
    parse_tool_calls,
    start_episodes,
    step_episodes,
)


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# ---------------------------------------------------------------------------------------------- parsing


def test_parse_finds_every_call_in_order():
    text = "Let me compute. " + call("calculator", expression="1+2") + " and " + call("lookup", key="x")
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error_kind) for c in calls] == [
        ("calculator", {"expression": "1+2"}, ""),
        ("lookup", {"key": "x"}, ""),
    ]
    assert parse_tool_calls("The answer is 3.") == []


@pytest.mark.parametrize(
    "text, kind, message",
    [
        ('<tool_call>{"name": "calculator", "arguments": {', "unclosed", "no closing </tool_call>"),
        ("<tool_call>{name: calculator}</tool_call>", "bad_json", "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', "bad_call", '{"name": ..., "arguments": {...}}'),
        ('<tool_call>{"arguments": {}}</tool_call>', "bad_call", '{"name": ..., "arguments": {...}}'),
        ('<tool_call>{"name": "c", "arguments": "{oops"}</tool_call>', "bad_json", "arguments are not valid"),
        ('<tool_call>{"name": "c", "arguments": [1, 2]}</tool_call>', "bad_arguments", "JSON object"),
    ],
)
def test_parse_malformed_calls(text, kind, message):
    (c,) = parse_tool_calls(text)
    assert c.error_kind == kind and message in c.error and c.arguments is None


def test_parse_arguments_given_as_a_json_string():
    (c,) = parse_tool_calls('<tool_call>{"name": "c", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    assert c.arguments == {"expression": "2*3"} and c.error_kind == ""


def test_parse_call_without_arguments_means_empty_arguments():
    (c,) = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert (c.name, c.arguments) == ("now", {})


# ------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("(17 + 3) * 4 / 5", 16),  # 20 * 4 = 80, / 5 = 16.0 -> integral float comes back as int
        ("7 / 2", 3.5),
        ("2 ** 10", 1024),
        ("-3 + +5", 2),
        ("10 % 4", 2),
        ("17 // 5", 3),
        ("1 / 3", 0.333333333333),  # 12 significant digits
        (" 12*34 ", 408),
    ],
)
def test_calculate(expression, value):
    result = calculate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    "expression, error, message",
    [
        ("__import__('os').system('ls')", ValueError, "unsupported element Call"),
        ("x + 1", ValueError, "unsupported element Name"),
        ("2 ** 2000", ValueError, "exponent 2000 is larger than 1000"),
        ("9 ** 9 ** 9", ValueError, "exponent 387420489"),  # right-associative: 9**9 first
        ("1e308 * 1e10", ValueError, "out of range"),
        ("10 ** 200", ValueError, "out of range"),
        ("1 / 0", ZeroDivisionError, "division by zero"),
        ("1 +", ValueError, "not an arithmetic expression"),
        ("'a' * 3", ValueError, "unsupported element Constant"),
        ("1" * 501, ValueError, "longer than 500"),
    ],
)
def test_calculate_refuses(expression, error, message):
    with pytest.raises(error, match=message):
        calculate(expression)


# ---------------------------------------------------------------------------------------------- toolbox


def shout(text: str, times: int = 1) -> str:
    if text == "boom":
        raise RuntimeError("exploded")
    return (text.upper() + " ") * times


SHOUT = Tool(
    "shout",
    "Upper-cases text.",
    {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer", "minimum": 1}},
        "required": ["text"],
        "additionalProperties": False,
    },
    shout,
)


def test_toolbox_runs_calls_and_answers_every_error():
    box = ToolBox([Calculator(), SHOUT], max_result_chars=12)
    results = box.run(
        call("calculator", expression="17*23")
        + call("shout", text="hi", times=2)
        + call("search", query="x")
        + call("calculator", expression=17)
        + call("shout", text="hi", loud=True)
        + call("shout", text="boom")
        + call("shout", text="abcdefghij", times=2)
        + "<tool_call>{]</tool_call>"
    )
    assert [(r.name, r.error_kind) for r in results] == [
        ("calculator", ""),
        ("shout", ""),
        ("search", "unknown_tool"),
        ("calculator", "bad_arguments"),
        ("shout", "bad_arguments"),
        ("shout", "tool_error"),
        ("shout", ""),
        (None, "bad_json"),
    ]
    contents = [r.content for r in results]
    assert contents[0] == "391" and contents[1] == "HI HI "
    assert contents[2] == "Error: unknown tool 'search' (tools: calculator, shout)"
    assert "(expression)" in contents[3] and "is not of type 'string'" in contents[3]
    assert "'loud' was unexpected" in contents[4]
    assert contents[5] == "Error: RuntimeError: exploded"
    assert contents[6] == "ABCDEFGHIJ A... [cut at 12 characters]"


def test_toolbox_schemas_and_bad_definitions():
    assert ToolBox([Calculator()]).schemas() == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": Calculator().description,
                "parameters": Calculator().parameters,
            },
        }
    ]
    with pytest.raises(ValueError, match="Two tools are named 'calculator'"):
        ToolBox([Calculator(), Calculator()])
    with pytest.raises(Exception, match="is not valid"):
        ToolBox([Tool("t", "", {"type": "no-such-type"}, print)])


# ---------------------------------------------------------------------------------------- environments


def test_tool_environment_turns():
    env = ToolEnvironment([Calculator()], max_calls_per_turn=2)
    assert isinstance(env, Environment)
    state = env.start({"answer": "391"})
    reply = env.step(state, {"role": "assistant", "content": "I think " + call("calculator", expression="17*23")})
    assert reply == EnvReply([{"role": "tool", "name": "calculator", "content": "391"}], False,
                             {"tool_calls": 1, "tool_errors": 0})
    final = env.step(state, {"role": "assistant", "content": "The answer is 391."})
    assert final.done and final.messages == [] and final.info == {"tool_calls": 0, "tool_errors": 0}
    # three calls, limit two: the third is answered, not run, and counts as an error; so does the bad one.
    many = env.step(state, {"role": "assistant", "content": call("calculator", expression="1+1")
                            + call("calculator", expression="1/0") + call("calculator", expression="2+2")})
    assert [m["content"] for m in many.messages] == [
        "2", "Error: ZeroDivisionError: division by zero",
        "Error: at most 2 tool calls per turn; this one was not run",
    ]
    assert many.info == {"tool_calls": 3, "tool_errors": 2}


class FlakyEnv:
    """Episode behaviour chosen by the message text: ok / raise / hang / wrong return type."""

    async def start(self, fields):
        if fields.get("fail"):
            raise KeyError("no such task")
        return dict(fields)

    async def step(self, state, message):
        text = message["content"]
        if text == "raise":
            raise RuntimeError("broken tool server")
        if text == "hang":
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        if text == "wrong":
            return {"done": True}
        return EnvReply([{"role": "user", "content": f"echo {text}"}], False, {"n": 1})


def test_step_episodes_isolates_errors_and_timeouts():
    env = FlakyEnv()
    starts = start_episodes(env, [{"id": 0}, {"fail": True}], timeout=5)
    assert starts[0].value == {"id": 0} and starts[0].error == ""
    assert starts[1].value is None and starts[1].error == "exception: KeyError: 'no such task'"
    env.cancelled = False
    out = step_episodes(
        env, [{}, {}, {}, {}], [{"content": c} for c in ("hi", "raise", "hang", "wrong")], timeout=0.5
    )
    assert env.cancelled  # the hanging episode's coroutine was cancelled at its timeout
    assert out[0].value == EnvReply([{"role": "user", "content": "echo hi"}], False, {"n": 1})
    assert out[1].error == "exception: RuntimeError: broken tool server"
    assert out[2].error == "timeout: no answer within 0.5 s"
    assert out[3].error == "exception: step returned dict, not EnvReply"


def test_step_episodes_runs_episodes_concurrently():
    """Each episode waits until all four are inside ``step`` at once: only a concurrent runner finishes."""

    class Rendezvous:
        def __init__(self, n):
            self.n, self.inside = n, 0

        def start(self, fields):  # a plain function (runs in a thread)
            return fields

        async def step(self, state, message):
            self.inside += 1
            while self.inside < self.n:
                await asyncio.sleep(0.01)
            return EnvReply([], True)

    out = step_episodes(Rendezvous(4), [{}] * 4, [{"content": ""}] * 4, timeout=10)
    assert all(o.error == "" and o.value.done for o in out)


def test_sync_environment_timeout_leaves_the_thread_behind():
    """A plain-function call past its timeout is abandoned, not joined (asyncio.to_thread would join it)."""
    release, finished = threading.Event(), []

    class Stuck:
        def start(self, fields):
            release.wait(60)
            finished.append(True)
            return fields

        def step(self, state, message):
            return EnvReply([], True)

    (o,) = start_episodes(Stuck(), [{}], timeout=0.2)
    assert o.error == "timeout: no answer within 0.2 s"
    assert finished == []  # returned while the call was still running
    release.set()


# ---------------------------------------------------------------------------------------------- python


@pytest.mark.parametrize(
    "code, expected",
    [
        ("print(6 * 7)", "42\n"),
        ("x = 1\nprint(x)\ny = 1 / 0", "1\nError: ZeroDivisionError: division by zero"),
        ("import sys\nsys.exit(3)", "Error: SystemExit: 3"),
        ("pass", "(no output)"),
        ("print('a' * 50)", "a" * 20 + "... [output cut at 20 characters]"),
        ("import socket\nsocket.create_connection(('127.0.0.1', 80))", "Error: PermissionError: sandbox: network"),
        ("open('/tmp/escaped', 'w')", "Error: PermissionError: sandbox: writing outside the sandbox directory"),
        ("while True:\n    pass", "Error: timeout: stopped after 1.0 s"),
    ],
)
def test_python_interpreter_tool(code, expected):
    box = ToolBox([PythonInterpreter(time_limit=1.0, max_output_chars=20)])
    (result,) = box.run(call("python", code=code))
    assert result.ok and result.name == "python"  # the program's failure is its output, not a tool error
    assert result.content.startswith(expected)


def test_tools_from_config_specs():
    from omegaconf import OmegaConf

    specs = OmegaConf.create(
        ["torchtune_grpo.multiturn.Calculator",
         {"_component_": "torchtune_grpo.multiturn.PythonInterpreter", "name": "py", "time_limit": 2}]
    )
    env = ToolEnvironment(specs)
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "py"]
    for spec, message in [
        ("calculator", "a dotted path"),
        ("torchtune_grpo.multiturn.Nope", "cannot be imported"),
        ({"_component_": "torchtune_grpo.multiturn.Calculator", "size": 3}, "unexpected keyword argument 'size'"),
        ("torchtune_grpo.multiturn.calculate", "missing 1 required positional argument"),
        ("json.dumps", "json.dumps"),
    ]:
        with pytest.raises(ValueError, match=message):
            ToolEnvironment([spec])
