"""Code execution: the sandbox's limits (time, memory, network, files, processes), the fraction of tests
passed on hand-made cases, code extraction, and CodeExecutionReward inside a RewardSet."""

import os
import socket
import tempfile
import threading
import time

import pytest

from torchtune_grpo.rewards import (
    CodeExecutionReward,
    RewardBatch,
    build_reward_set,
    extract_code,
    network_namespace_available,
    normalize_tests,
    run_python_tests,
)

ADD = "def add(a, b):\n    return a + b\n"
# Small limits keep the suite fast; memory 256 MiB is far above what `python -I -S` needs (~20 MiB).
FAST = {"time_limit": 3.0, "memory_limit_mb": 256}
needs_namespace = pytest.mark.skipif(not network_namespace_available(), reason="unprivileged namespaces unavailable")


def fenced(code):
    return f"Reasoning.\n</think>\n<answer>\n```python\n{code}```\n</answer>"


# ---------------------------------------------------------------- fraction of tests passed


def test_fraction_of_assert_tests():
    # 4 tests: add works for 3 of them; "add(1, 1) == 3" fails. Fraction 3/4.
    tests = ["assert add(1, 2) == 3", "assert add(1, 1) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'"]
    res = run_python_tests(ADD, tests, **FAST)
    assert (res.passed, res.total, res.status) == (3, 4, "ok")
    assert res.results == [True, False, True, True]
    assert res.reasons[1].startswith("AssertionError")
    assert res.fraction == 0.75


def test_fraction_of_io_tests():
    # stdin/stdout: doubles the number. Third case expects 9 (wrong), fourth has trailing whitespace (ok).
    code = "n = int(input())\nprint(n * 2)\n"
    tests = [{"input": "3", "output": "6"}, {"input": "0\n", "output": "0\n"}, {"input": "4", "output": "9"},
             {"input": "5", "output": "10   \n\n"}]
    res = run_python_tests(code, tests, **FAST)
    assert res.results == [True, True, False, True]
    assert res.reasons[2] == "wrong output"


def test_solution_that_raises_fails_every_test():
    res = run_python_tests("raise ValueError('nope')", ["assert True", "assert 1"], **FAST)
    assert res.passed == 0 and res.reasons[0].startswith("solution raised ValueError: nope")


def test_exit_calls_in_io_programs():
    ok = run_python_tests("print('hi')\nexit(0)", [{"input": "", "output": "hi"}], **FAST)
    bad = run_python_tests("print('hi')\nimport sys\nsys.exit(3)", [{"input": "", "output": "hi"}], **FAST)
    assert ok.passed == 1 and bad.passed == 0


def test_normalize_tests_shapes():
    assert normalize_tests(["assert f()"]) == [{"kind": "assert", "source": "assert f()"}]
    assert normalize_tests('["assert f()"]') == [{"kind": "assert", "source": "assert f()"}]
    assert normalize_tests({"inputs": ["1", "2"], "outputs": ["1", "4"]}) == [
        {"kind": "io", "input": "1", "output": "1"}, {"kind": "io", "input": "2", "output": "4"}]
    assert normalize_tests('{"input": "1", "output": "2"}') == [{"kind": "io", "input": "1", "output": "2"}]
    assert normalize_tests("assert f() == 1\nassert g()") == [{"kind": "assert", "source": "assert f() == 1\nassert g()"}]
    assert normalize_tests(normalize_tests(["assert x"])) == normalize_tests(["assert x"])  # idempotent
    for bad in ([], "", "  ", {"a": 1}, [3], {"inputs": ["1"], "outputs": []}):
        with pytest.raises(ValueError):
            normalize_tests(bad)


# ---------------------------------------------------------------- limits


def test_infinite_loop_is_killed_within_the_limit():
    # A limit of 0.5 s (not 1 s: nothing has to finish inside it, the loop only has to be stopped at it); the
    # bound keeps its 1.5 s of slack past the limit for starting and killing the process group.
    start = time.monotonic()
    res = run_python_tests("while True:\n    pass\n", ["assert True"], time_limit=0.5, memory_limit_mb=256)
    elapsed = time.monotonic() - start
    assert res.status == "timeout" and res.passed == 0
    assert elapsed < 2.0


def test_sleeping_forever_is_killed():
    # 0.5 s and 1.5 s of slack, as above.
    res = run_python_tests("import time\ntime.sleep(1000)", ["assert True"], time_limit=0.5)
    assert res.status == "timeout" and res.seconds < 2.0


def test_tests_finished_before_a_kill_still_count():
    # Test 0 passes, test 1 loops forever: the process is killed, but the first result was already written.
    res = run_python_tests(ADD, ["assert add(1, 2) == 3", "while True: pass", "assert True"], time_limit=1.0)
    assert res.status == "timeout"
    assert res.results == [True, False, False]


def test_per_test_time_limit_lets_later_tests_run():
    res = run_python_tests(ADD, ["while True: pass", "assert add(2, 2) == 4"], time_limit=3.0, test_time_limit=0.3)
    assert res.status == "ok" and res.results == [False, True]
    assert res.reasons[0].startswith("TestTimeout")


def test_unbounded_allocation_is_stopped():
    code = "hog = []\nwhile True:\n    hog.append(bytearray(50 * 1024 * 1024))\n"
    start = time.monotonic()
    res = run_python_tests(code, ["assert True"], time_limit=5.0, memory_limit_mb=256)
    assert res.passed == 0 and "MemoryError" in res.reasons[0]
    assert time.monotonic() - start < 4.0


def test_one_huge_allocation_fails_only_its_test():
    res = run_python_tests(ADD, ["x = bytearray(10 ** 12)", "assert add(1, 1) == 2"], **FAST)
    assert res.results == [False, True] and "MemoryError" in res.reasons[0]


def test_cpu_limit_backs_up_the_wall_clock():
    # A CPU loop that ignores SIGALRM and outlives its soft per-test limit still ends by RLIMIT_CPU or the kill.
    code = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True: pass\n"
    # Wall limit 0.5 s (RLIMIT_CPU stays ceil(0.5) + 1 = 2 s, as at 1 s), 2 s of slack as before.
    res = run_python_tests(code, ["assert True"], time_limit=0.5, test_time_limit=0.2)
    assert res.status in ("timeout", "crashed") and res.seconds < 2.5


def test_crash_is_reported():
    res = run_python_tests("import os\nos._exit(3)", ["assert True"], **FAST)
    assert res.status == "crashed" and res.passed == 0


# ---------------------------------------------------------------- network


@pytest.fixture
def tcp_server():
    """A TCP server on the host's loopback that counts the connections it accepts."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            accepted.append(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join()
    srv.close()
    for c in accepted:
        c.close()


CONNECT = "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"


@pytest.mark.parametrize("network", ["audit", "auto"])
def test_socket_open_fails(network, tcp_server):
    port, accepted = tcp_server
    res = run_python_tests("import socket\nsocket.socket()", ["assert True"], network=network, **FAST)
    assert res.passed == 0 and "PermissionError" in res.reasons[0] and "network" in res.reasons[0]
    res = run_python_tests(CONNECT.format(port=port), ["assert True"], network=network, **FAST)
    assert res.passed == 0
    res = run_python_tests("import urllib.request\nurllib.request.urlopen('http://127.0.0.1:%d')" % port,
                           ["assert True"], network=network, **FAST)
    assert res.passed == 0
    time.sleep(0.3)
    assert accepted == []  # nothing ever reached the host


@needs_namespace
def test_network_namespace_blocks_even_without_the_audit_hook(tcp_server):
    # With the audit hook off, only the kernel namespace stands between the code and the host's loopback.
    port, accepted = tcp_server
    control = run_python_tests(CONNECT.format(port=port), ["assert True"], network="audit", block_sockets=False,
                               **FAST)
    assert control.passed == 1  # sanity: without either layer the connection works
    res = run_python_tests(CONNECT.format(port=port), ["assert True"], network="namespace", block_sockets=False,
                           **FAST)
    assert res.passed == 0 and ("OSError" in res.reasons[0] or "unreachable" in res.reasons[0].lower())
    time.sleep(0.3)
    assert len(accepted) == 1  # only the control run's connection


def test_namespace_mode_requires_namespaces(monkeypatch):
    from torchtune_grpo.rewards import _sandbox

    monkeypatch.setattr(_sandbox, "network_namespace_available", lambda python=None: False)
    with pytest.raises(RuntimeError, match="user namespaces"):
        run_python_tests(ADD, ["assert True"], network="namespace")
    # auto falls back to the audit hook: sockets are still blocked.
    res = run_python_tests("import socket\nsocket.socket()", ["assert True"], network="auto", **FAST)
    assert res.passed == 0 and "PermissionError" in res.reasons[0]


# ---------------------------------------------------------------- files and processes


def test_files_stay_in_a_throwaway_directory(tmp_path, monkeypatch):
    outside = tmp_path / "victim.txt"
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch_root))  # where the sandbox directory is created
    code = (
        "import os\n"
        "open('scratch.txt', 'w').write('ok')\n"  # relative: inside the sandbox directory
        "os.mkdir('sub'); open('sub/x', 'w').write('1')\n"
        "cwd = os.getcwd()\n"
    )
    tests = [
        "assert open('scratch.txt').read() == 'ok'",
        f"open({str(outside)!r}, 'w').write('pwned')",  # blocked
        f"import os; os.symlink({str(outside)!r}, 'link'); open('link', 'w').write('pwned')",  # blocked
        "import os; assert os.environ['HOME'] == cwd and os.environ['TMPDIR'] == cwd",
        "import os; assert sorted(os.environ) == ['HOME', 'LANG', 'PATH', 'TMPDIR']",
        "import tempfile; open(tempfile.mktemp(), 'w').write('in tmpdir')",  # TMPDIR is the sandbox dir
        "import os; os.remove('/etc/hostname')",  # blocked
        "print(cwd, file=open('where.txt', 'w'))",
    ]
    res = run_python_tests(code, tests, **FAST)
    assert res.results == [True, False, False, True, True, True, False, True]
    assert "outside the sandbox directory" in res.reasons[1]
    assert not outside.exists()
    # The sandbox directory, with everything written into it, is gone afterwards.
    assert list(scratch_root.iterdir()) == []


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.system('true')",
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.fork()",
        "import ctypes",
        "import os, signal\nos.kill(os.getppid() or 12345, signal.SIGTERM)",
    ],
)
def test_processes_and_native_code_are_blocked(code):
    res = run_python_tests(code, ["assert True"], **FAST)
    assert res.passed == 0, res.reasons


# ---------------------------------------------------------------- extraction and the reward


def test_extract_code():
    text = "```\nplain\n```\nthen\n```python\nprint(1)\n```\nand ```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"  # the last python-labelled block
    assert extract_code("```\nonly plain\n```") == "only plain\n"
    assert extract_code("```python\nunclosed") is None
    assert extract_code("no code") is None
    assert extract_code("```python\n   \n```") is None
    assert extract_code("<answer>\n```python\nx = 1\n```\n</answer>", "answer_tag") == "x = 1\n"
    assert extract_code("<answer>x = 2</answer>", "answer_tag") == "x = 2"
    assert extract_code("x = 3", "raw") == "x = 3"
    with pytest.raises(ValueError):
        extract_code("x", "xml")
    # Hostile fences stay linear-time (a lazy regex is quadratic on these).
    start = time.perf_counter()
    assert extract_code("```" * 50_000) is None
    assert extract_code("```" * 50_000 + "\n" + "```python\n" * 20_000) is None
    assert extract_code("x ``` ```python\nprint(3)\n```") == "print(3)\n"
    assert time.perf_counter() - start < 1.0


def make_batch(completions, tests):
    n = len(completions)
    return RewardBatch(["p"] * n, list(completions), [[1]] * n, [{"answer": "", "tests": t} for t in tests])


def test_code_reward_in_reward_set():
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
    completions = [
        fenced(ADD),  # 2/2
        fenced("def add(a, b):\n    return 3\n"),  # 1/2
        "I don't know.",  # no code: 0, not an error
        fenced("while True: pass\n"),  # killed: 0
        fenced("import socket\nsocket.socket().connect(('8.8.8.8', 53))\n" + ADD),  # blocked: 0
        fenced(ADD),  # no tests in the dataset row: an error, fallback
    ]
    rows = [tests] * 5 + [[]]
    rs = build_reward_set(
        [{"_component_": "torchtune_grpo.rewards.CodeExecutionReward", "time_limit": 1.0, "memory_limit_mb": 256,
          "fallback": -1.0, "name": "code"}]
    )
    assert rs.per_sample == [True] and rs.concurrency[0] == (os.cpu_count() or 1)
    start = time.monotonic()
    out = rs(make_batch(completions, rows))
    assert out.per_component["code"].tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, -1.0]
    assert out.errors == {"code": 1}
    assert time.monotonic() - start < 6.0


def test_code_reward_validation(monkeypatch):
    with pytest.raises(ValueError, match="extract"):
        CodeExecutionReward(extract="xml")
    with pytest.raises(ValueError, match="network"):
        CodeExecutionReward(network="none")
    from torchtune_grpo.rewards import _code

    monkeypatch.setattr(_code, "network_namespace_available", lambda: False)
    with pytest.raises(RuntimeError, match="namespaces"):
        CodeExecutionReward(network="namespace")
