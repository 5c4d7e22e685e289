"""The program :func:`torchtune_grpo.rewards._sandbox.run_python_tests` runs in its sandboxed interpreter.

It is source text, not imported code: the child runs it with ``python -I [-S] -c`` (no site-packages, no
environment), so it may use the standard library only.
"""

__all__ = ["RUNNER"]

# The program the sandboxed interpreter runs. It reads its job (JSON) from stdin, applies the limits, opens
# the results file, installs the audit hook, then runs the tests one by one and writes one line per test
# ("<nonce> <index> <1|0> <reason>") as soon as it is known, so the tests that finished before a kill count.
RUNNER = r'''
def _main():
    import builtins, io, json, os, resource, signal, sys, threading
    job = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    sys.stdin = io.StringIO("")
    for res, value in ((resource.RLIMIT_AS, job["memory_bytes"]), (resource.RLIMIT_CPU, job["cpu_seconds"]),
                       (resource.RLIMIT_FSIZE, job["fsize_bytes"]), (resource.RLIMIT_CORE, 0)):
        if value is not None:
            try:
                resource.setrlimit(res, (value, value))
            except (ValueError, OSError):
                pass
    out = open(job["results_path"], "w", buffering=1, encoding="utf-8")
    nonce = job["nonce"]
    workdir = os.path.realpath(job["workdir"])
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    process_events = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                      "os.forkpty", "pty.spawn", "os.startfile", "os.fexecve"}
    path_events = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
                   "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,), "os.lchflags": (0,),
                   "os.lchown": (0,), "os.mkfifo": (0,), "os.mknod": (0,), "os.setxattr": (0,),
                   "os.removexattr": (0,), "shutil.rmtree": (0,), "os.rename": (0, 1), "os.link": (0, 1),
                   "os.symlink": (1,), "shutil.copyfile": (1,), "shutil.copymode": (1,),
                   "shutil.copystat": (1,), "shutil.chown": (0,)}
    local = threading.local()
    block_sockets, block_processes = job["block_sockets"], job["block_processes"]
    restrict_writes = job["restrict_writes"]

    def inside(path):
        if isinstance(path, int):
            return True  # an already open file descriptor
        try:
            p = os.path.realpath(os.fsdecode(path))
        except Exception:
            return False
        return p == workdir or p.startswith(workdir + os.sep) or p == "/dev/null"

    def deny(what):
        raise PermissionError("sandbox: " + what + " is not allowed")

    def hook(event, args):
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            if block_sockets and event.startswith("socket."):
                deny("network access (" + event + ")")
            if block_processes and event in process_events:
                deny("starting processes (" + event + ")")
            if event in ("os.kill", "os.killpg", "signal.pthread_kill") and args and args[0] not in (0, os.getpid()):
                deny("signalling other processes")
            if event.startswith("ctypes.dlopen") or event == "ctypes.dlsym":
                deny("loading native code with ctypes")
            if restrict_writes:
                if event == "open" and len(args) >= 3:
                    path, mode, flags = args[0], args[1], args[2]
                    writing = (isinstance(flags, int) and flags >= 0 and flags & write_flags) or (
                        isinstance(mode, str) and any(c in mode for c in "wax+"))
                    if writing and not inside(path):
                        deny("writing outside the sandbox directory (" + os.fsdecode(path) + ")")
                elif event in path_events:
                    for k in path_events[event]:
                        if k < len(args) and args[k] is not None and not inside(args[k]):
                            deny(event + " outside the sandbox directory")
        finally:
            local.busy = False

    def _exit(code=None):
        raise SystemExit(code)

    builtins.exit = builtins.quit = _exit  # absent under -S

    class TestTimeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise TestTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    per_test = job["test_time_limit"]
    code, tests = job["code"], job["tests"]
    del job
    sys.addaudithook(hook)

    def report(i, ok, reason=""):
        out.write("%s %d %d %s\n" % (nonce, i, 1 if ok else 0, reason.replace("\n", " ")[:200]))
        out.flush()

    def run(source, filename, ns):
        if per_test:
            signal.setitimer(signal.ITIMER_REAL, per_test)
        try:
            exec(compile(source, filename, "exec"), ns)
        finally:
            if per_test:
                signal.setitimer(signal.ITIMER_REAL, 0)

    def norm(text):
        return "\n".join(line.rstrip() for line in text.strip().splitlines())

    class Capped(io.StringIO):
        """stdout of a program run: keeps the first ``limit`` characters, counts the rest."""

        def __init__(self, limit):
            super().__init__()
            self.limit, self.size, self.cut = limit, 0, False

        def write(self, text):
            room = self.limit - self.size
            if len(text) > room:
                self.cut = True
                text = text[:max(room, 0)]
            self.size += len(text)
            return super().write(text) if text else 0

    real_stdout = sys.stdout
    module_ns = None
    for i, test in enumerate(tests):
        try:
            if test["kind"] == "assert":
                if module_ns is None:
                    module_ns = {"__name__": "solution", "__builtins__": builtins}
                    try:
                        run(code, "solution.py", module_ns)
                    except BaseException as e:
                        module_ns = e
                if isinstance(module_ns, BaseException):
                    report(i, False, "solution raised %s: %s" % (type(module_ns).__name__, str(module_ns)[:100]))
                    continue
                run(test["source"], "test_%d.py" % i, module_ns)
                report(i, True)
            elif test["kind"] == "program":
                limit = test["max_output"]
                sys.stdout = captured = Capped(limit)
                error = ""
                try:
                    run(code, "program.py", {"__name__": "__main__", "__builtins__": builtins})
                except SystemExit as e:
                    if e.code not in (None, 0):
                        error = "SystemExit: %s" % (e.code,)
                except BaseException as e:
                    error = type(e).__name__ + ": " + str(e)[:300]
                finally:
                    sys.stdout = real_stdout
                payload = {"stdout": captured.getvalue(), "cut": captured.cut, "error": error}
                out.write("%s %d %d %s\n" % (nonce, i, 0 if error else 1, json.dumps(payload)))
                out.flush()
            else:
                sys.stdin = io.StringIO(test["input"])
                sys.stdout = captured = io.StringIO()
                try:
                    run(code, "solution.py", {"__name__": "__main__", "__builtins__": builtins})
                except SystemExit as e:
                    if e.code not in (None, 0):
                        raise
                finally:
                    sys.stdout, sys.stdin = real_stdout, io.StringIO("")
                got, want = norm(captured.getvalue()), norm(test["output"])
                report(i, got == want, "" if got == want else "wrong output")
        except BaseException as e:
            sys.stdout = real_stdout
            report(i, False, type(e).__name__ + ": " + str(e)[:100])
    out.close()
    os._exit(0)


_main()
'''
