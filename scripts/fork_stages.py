"""Python commands forked from one process that imported the heavy packages once.

The GPU check's CPU rehearsal (``scripts/gpu_check.sh --fork-stages``, tests/test_gpu_check.py) runs eight Python
stages on tiny models; importing torch, torchtune, torchao, transformers and TRL took each of them ~7 s of its
~10-40 s. Here a server imports them once, and each stage is a child forked from it: a fresh copy of a process
that has imported modules and done nothing else (no model built, no thread pool started, nothing compiled).
The tests' ``tune run`` and its ranks start the same way (tests/_tune_server.py).

    python scripts/fork_stages.py serve SOCKET [--hide NAME,...] [MODULE ...]   # import the MODULEs, then fork
    python scripts/fork_stages.py run SOCKET ARGS...          # what `python ARGS...` does, in a forked child

``serve`` writes the top-level names of the modules it imported to ``SOCKET.modules``, one a line, before the
socket appears.

``run`` stands in for the interpreter: ARGS is ``[-u] SCRIPT [ARG ...]`` or ``[-u] -m MODULE [ARG ...]``. The
child gets the caller's standard streams, working directory, environment and arguments, runs the script or module as
``__main__`` (``sys.path[0]`` as the interpreter sets it) and exits as the interpreter does (``SystemExit``,
an uncaught exception: 1, non-daemon threads joined, atexit handlers, streams flushed), but without the
interpreter's finalization (module and object teardown), which a forked child would pay for the server's objects. ``run`` exits with the child's status, or dies of the child's
signal; a signal it receives (``timeout``'s SIGTERM) goes to the child's process group, and the server kills
that group if ``run`` goes away. The modules imported before the fork stay imported: an environment variable
that a module reads at import time has the server's value (the same environment, where the GPU check
starts the server); the variables those imports set (vLLM sets a few) are set again in the child's environment,
as a fresh interpreter's imports would set them, where the caller's value is the one the imports saw or the one
they set (otherwise, and where a folder the caller's ``PYTHONPATH`` adds holds a module of the same name as one
the server imported, the command runs in a fresh interpreter instead, saying so on its stderr: what the server
imported cannot stand in for it). Of what the interpreter reads from the environment at start-up, the child
honours
``PYTHONPATH`` (for what it imports afterwards), ``PYTHONUNBUFFERED`` (as ``-u``) and ``PYTHONFAULTHANDLER`` (where the
server imported torch, a fatal signal then prints every thread's C++ stack too); its
standard streams are buffered as a fresh interpreter's would be on the caller's (line-buffered on a
terminal). The server ends when the process that started it has gone.

``--hide``: packages the stages must not see, as on the GPU machine, which does not have them (the rehearsal hides
the CPU build of vLLM that this environment has for its tests: TRL imports it whenever it is installed, ~7 s a
stage, though the check never runs it). For them ``import`` raises ImportError and ``importlib.util.find_spec``
returns None, as for a package that is not installed.
"""

import faulthandler
import gc
import io
import json
import os
import select
import signal
import socket
import sys
import time
from typing import List, Tuple

_MAX_MESSAGE = 1 << 20  # the request: argv, cwd and the environment as JSON


def _serve(path: str, modules: List[str]) -> Tuple[socket.socket, dict]:
    """Import ``modules``, then accept commands; returns ``(connection, request)`` in each forked child, the request
    with ``env_changes``: ``{name: (before, after)}`` for every environment variable the imports set or removed."""
    import importlib

    if modules[:1] == ["--hide"]:
        for name in modules[1].split(","):
            sys.modules[name] = None  # what the import system reads as "not installed"
        modules = modules[2:]
    before = dict(os.environ)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the command that needs it imports it again and reports it
            print(f"fork_stages.py serve: importing {name} failed ({type(e).__name__}: {e})", file=sys.stderr)
    sys.stdout.flush()  # nothing the imports printed may sit in a buffer every child would inherit
    sys.stderr.flush()
    env_changes = {k: (before.get(k), os.environ.get(k)) for k in {*before, *os.environ}
                   if before.get(k) != os.environ.get(k)}
    with open(path + ".modules", "w") as f:  # for a caller choosing between servers (tests/_tune_server.py)
        f.write("".join(f"{name}\n" for name in sorted(_imported())))
    # What the imports made lives as long as every child: out of the collector's sight (Python's advice for a
    # process that forks without exec), so that a child's full collections do not walk it again (vLLM's engine
    # start runs five, ~1 s with vLLM imported) nor touch its pages.
    gc.collect()
    gc.freeze()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the path appears once the server listens: `run` waits for it
    server.listen(8)
    server.settimeout(1.0)
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # whoever started the server is gone (killed): no one will stop it
            server.close()
            os.unlink(path)
            sys.exit(0)
        while True:  # reap the children that have finished
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        try:
            conn, _ = server.accept()
        except socket.timeout:
            continue
        if os.fork() == 0:  # the child: one command
            server.close()
            conn.settimeout(None)
            data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
            return conn, {**json.loads(data.decode()), "fds": fds, "env_changes": env_changes}
        conn.close()


def _supervise(conn: socket.socket, request: dict) -> dict:
    """In the forked child: fork the command's process, relay its pid and exit status over ``conn``, kill its
    process group if the caller goes away; returns the request in the command's process."""
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)  # its own group: a signal to the command reaches what it started, as under a shell
        conn.close()
        return request
    conn.sendall(f"pid {pid}\n".encode())
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)  # negative: killed by that signal
            try:
                conn.sendall(f"exit {code}\n".encode())
            except OSError:
                pass
            os._exit(0)
        readable, _, _ = select.select([conn], [], [], 0.05)  # the status within 50 ms of the exit
        if readable and not conn.recv(64):  # the caller is gone (killed): so is the command
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _use_pythonpath(server: str, caller: str) -> None:
    """sys.path as the caller's PYTHONPATH makes it: the server's entries out, the caller's in their place (a
    folder the caller added, an optional package's, is found; a module the server imported stays imported)."""
    if server == caller:
        return
    import importlib

    drop = {os.path.abspath(p) for p in server.split(os.pathsep) if p}
    kept = [p for p in sys.path[1:] if not p or os.path.abspath(p) not in drop]
    sys.path[1:] = [os.path.abspath(p) for p in caller.split(os.pathsep) if p] + kept
    importlib.invalidate_caches()


def _imported() -> set:
    """The top-level names of the modules imported (not those hidden)."""
    return {name for name, module in sys.modules.items() if module is not None and "." not in name}


def shadowed(server: str, caller: str, imported: set) -> List[str]:
    """``folder: name`` for every module of ``imported`` (top-level names) that a folder the ``caller`` PYTHONPATH
    adds to the ``server``'s also holds: the caller's own interpreter would import that one instead."""
    added = [p for p in caller.split(os.pathsep) if p and os.path.abspath(p) not in
             {os.path.abspath(q) for q in server.split(os.pathsep) if q}]
    found = []
    for folder in added:
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        stems = {e.split(".")[0] if e.endswith((".py", ".so")) else e for e in entries}
        found += [f"{folder}: {name}" for name in sorted(stems & imported)]
    return found


def _run_command(request: dict) -> None:
    """Become ``python ARGS...`` with the caller's streams, directory and environment (never returns)."""
    import runpy

    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    server_path, caller_path = os.environ.get("PYTHONPATH", ""), request["env"].get("PYTHONPATH", "")
    env = dict(request["env"])
    # The imports' environment changes, as the caller's own imports would make them: only where the caller's value
    # is the one the server's imports saw, or already the one they set (a command that a forked one started, such
    # as torchrun's ranks); a change computed from another value cannot be replayed.
    differs = [k for k, (old, new) in request["env_changes"].items() if env.get(k) not in (old, new)]
    for key, (_, new) in request["env_changes"].items():
        if new is None:
            env.pop(key, None)
        else:
            env[key] = new
    shadows = shadowed(server_path, caller_path, _imported())
    if shadows or differs:
        why = f"{', '.join(shadows)} shadow(s) what the server imported" if shadows else \
            f"the server's imports set {', '.join(differs)} from another value"
        print(f"fork_stages.py run: {why}: running a fresh interpreter", file=sys.stderr, flush=True)
        os.execve(sys.executable, [sys.executable, *request["argv"]], request["env"])
    _use_pythonpath(server_path, caller_path)
    os.environ.clear()
    os.environ.update(env)
    args = request["argv"]
    unbuffered = args[0] == "-u" or bool(os.environ.get("PYTHONUNBUFFERED"))
    args = args[1:] if args[0] == "-u" else args
    # The streams the interpreter would have made for the caller's descriptors (the server's were made for its
    # own): a terminal line-buffered, a pipe or file block-buffered (stderr always by line), -u: neither.
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "w", closefd=False)
        line = fd == 2 or raw.isatty()
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=old.encoding,
                                  errors=old.errors, line_buffering=line and not unbuffered, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()  # onto the caller's stderr (fd 2 by now)
        _native_stacks_on_fatal_signal()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        if args[0] == "-m":
            sys.argv, sys.path[0] = [args[1]] + args[2:], os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv, sys.path[0] = args, os.path.dirname(os.path.realpath(script))
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:  # as the interpreter reads it: None 0, an int itself, anything else printed, 1
        code = stop.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        code = code or 0
    except KeyboardInterrupt:  # the interpreter's traceback, then death by SIGINT
        sys.excepthook(*sys.exc_info())
        _leave(0, signal.SIGINT)
    except BaseException:  # noqa: B902 - an uncaught exception: its traceback, status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    _leave(code)


def _native_stacks_on_fatal_signal() -> None:
    """With torch imported: on SIGSEGV, SIGABRT and the like, every thread's C++ stack too, before faulthandler's
    Python stacks. A crash in a thread Python does not know (a gloo worker's) otherwise shows no frame of where it
    happened. torch's switch is private (``torch._C``); its own distributed test harness turns it on the same way
    (torch.testing._internal.common_distributed), and only the commands this server runs use it."""
    torch = sys.modules.get("torch")
    switch = getattr(getattr(torch, "_C", None), "_set_print_stack_traces_on_fatal_signal", None)
    if switch is not None:
        switch(True)


def _leave(code: int, die_of: int = 0) -> None:
    """Exit as the interpreter does, minus its finalization: non-daemon threads joined, atexit handlers run (they
    include ``logging.shutdown``, ``weakref.finalize`` and multiprocessing's children), the standard streams
    flushed; then ``os._exit``. Finalizing would tear down every module and object, most of them the server's
    (inherited pages each written again): 0.6 s for a command that did nothing, 2-3 s after a vLLM engine ran."""
    import atexit
    import threading

    # What the interpreter does first at exit: the threading module's exit calls (concurrent.futures' tells idle
    # pool workers to leave: a pool nobody shut down, vLLM's renderer's, would otherwise be joined forever), then
    # every non-daemon thread joined.
    threading._shutdown()  # noqa: SLF001 - what the interpreter itself calls at exit
    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter itself calls at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed stream or a reader gone: as the interpreter, nothing to report
            pass
    if die_of:
        signal.signal(die_of, signal.SIG_DFL)
        os.kill(os.getpid(), die_of)
    os._exit(code)


def _client(path: str, args: List[str]) -> int:
    """Send ``args`` with this process's streams, directory and environment; return the command's status."""
    command = args[1:] if args[:1] == ["-u"] else args
    if not command or command == ["-m"] or command[0].startswith("-") and command[0] != "-m":
        print(f"fork_stages.py run: expected [-u] SCRIPT ... or [-u] -m MODULE ..., got {args}", file=sys.stderr)
        return 2
    deadline = time.monotonic() + 600  # the server imports first
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"fork_stages.py run: no server at {path} after 600 s", file=sys.stderr)
            return 1
        time.sleep(0.05)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = json.dumps({"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(conn, [request], [0, 1, 2])
    reader = conn.makefile("r")
    pid = int(reader.readline().split()[1])

    def forward(signum, _frame):
        try:
            os.killpg(pid, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    line = reader.readline()
    if not line:
        print("fork_stages.py run: the server went away", file=sys.stderr)
        return 1
    code = int(line.split()[1])
    if code < 0:  # die of the same signal, as the command did
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot have a handler (EINVAL)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("serve", "run"):
        sys.exit(__doc__)
    if sys.argv[1] == "run":
        sys.exit(_client(sys.argv[2], sys.argv[3:]))
    child = _serve(sys.argv[2], sys.argv[3:])
    request = _supervise(*child)
    _run_command(request)


if __name__ == "__main__":
    main()
