"""Running reward code with time limits: per-sample thread workers, whole-call timeouts, coroutines.

Python cannot kill a thread. When a sample runs past its timeout, :func:`run_each` gives up on it at once
(the caller scores it with the fallback) and asks the interpreter to raise :class:`RewardCancelled` inside
the worker thread (``PyThreadState_SetAsyncExc``). That stops pure-Python loops within a few bytecodes; code
blocked inside a C call (a long regex match, ``time.sleep``, a socket read) only stops when the call
returns. Worker threads are daemon threads, so a thread that never stops cannot keep the process alive at
exit. Code that may loop forever or exhaust memory for real (model-written code) belongs in a separate
process: see :mod:`torchtune_grpo.rewards._sandbox`.

A worker thread starts with torch's per-thread defaults, not the caller's: :func:`run_each` gives each worker
the calling thread's grad mode and current CUDA device, so a reward computes the same in a worker as in the
calling thread (a judge on ``device="cuda"`` stays on this rank's GPU, not cuda:0).
"""

import asyncio
import ctypes
import inspect
import logging
import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional

__all__ = ["Outcome", "RewardCancelled", "RewardTimeoutError", "call_with_timeout", "resolve_awaitable", "run_each"]

log = logging.getLogger(__name__)


class RewardCancelled(BaseException):
    """Raised inside a worker thread whose sample timed out, to stop it. A BaseException, so that a
    reward's own ``except Exception`` does not swallow it."""


class RewardTimeoutError(TimeoutError):
    """A reward took longer than its timeout; the sample (or batch) is scored with the fallback."""


class Outcome(NamedTuple):
    """The result of running reward code on one sample (or one batch).

    Attributes:
        status (str): ``"ok"``, ``"error"`` or ``"timeout"``.
        value (Any): the returned value (``"ok"``), the exception (``"error"``, ``"timeout"``).
    """

    status: str
    value: Any


def resolve_awaitable(value: Any) -> Any:
    """Returns ``value``, or, when it is awaitable (an ``async def`` reward's result), what it resolves to.

    The coroutine runs with :func:`asyncio.run` in the calling thread, or in a helper thread when the
    calling thread already runs an event loop.

    Args:
        value (Any): a reward's return value.

    Returns:
        Any: the value itself or the coroutine's result.
    """
    if not inspect.isawaitable(value):
        return value

    async def _await() -> Any:
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await())
    # This thread already runs a loop (a notebook, an async caller): run the coroutine in its own thread.
    box: List[Outcome] = []

    def _target() -> None:
        try:
            box.append(Outcome("ok", asyncio.run(_await())))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            box.append(Outcome("error", e))

    t = threading.Thread(target=_target, name="reward-async", daemon=True)
    t.start()
    t.join()
    if box[0].status == "error":
        raise box[0].value
    return box[0].value


def _cancel_thread(thread: threading.Thread) -> None:
    """Asks CPython to raise :class:`RewardCancelled` in ``thread`` at its next bytecode (best effort)."""
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return
    set_async_exc = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if set_async_exc is None:  # not CPython
        return
    set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(RewardCancelled))


def _caller_torch_state() -> Callable[[], None]:
    """Returns a function that sets, in another thread, the calling thread's grad mode and current CUDA
    device (both are per thread in torch; a new thread has grad enabled and device 0)."""
    import torch  # the rewards package imports torch anyway; kept local to this one use

    grad = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def apply() -> None:
        torch.set_grad_enabled(grad)
        if device is not None:
            torch.cuda.set_device(device)

    return apply


def _run_one(fn: Callable[[int], Any], i: int) -> Outcome:
    try:
        return Outcome("ok", resolve_awaitable(fn(i)))
    except (RewardCancelled, KeyboardInterrupt):
        raise  # a cancelled worker stops; Ctrl-C still stops the run
    except BaseException as e:  # noqa: BLE001 - incl. SystemExit from reward code: this sample fails
        return Outcome("error", e)


def run_each(
    fn: Callable[[int], Any],
    n: int,
    timeout: Optional[float] = None,
    concurrency: int = 1,
    poll_interval: float = 0.05,
) -> List[Outcome]:
    """Runs ``fn(i)`` for ``i`` in ``range(n)``, each with its own time limit and exception handling.

    With no timeout and ``concurrency == 1`` the calls run in order in the calling thread. Otherwise up to
    ``concurrency`` daemon worker threads take the indices in order; a call that runs longer than
    ``timeout`` seconds (measured from its own start) is given up at once (outcome ``"timeout"``), its
    worker is cancelled (see the module docstring) and a fresh worker takes its place, so one stuck
    sample never holds up the others. Awaitable results are resolved (``async def`` rewards).

    Args:
        fn (Callable[[int], Any]): called with a sample index.
        n (int): number of samples.
        timeout (Optional[float]): seconds per call. Default is None (no limit).
        concurrency (int): number of calls in flight at once. Default is 1.
        poll_interval (float): longest wait between checks of the deadlines, in seconds. Default is 0.05.

    Returns:
        List[Outcome]: one outcome per index: ``("ok", value)``, ``("error", exception)`` or
        ``("timeout", RewardTimeoutError)``.
    """
    if n == 0:
        return []
    concurrency = max(1, int(concurrency))
    if timeout is None and concurrency == 1:
        return [_run_one(fn, i) for i in range(n)]

    cond = threading.Condition()
    outcomes: List[Optional[Outcome]] = [None] * n
    started: List[Optional[float]] = [None] * n
    owner: List[Optional[threading.Thread]] = [None] * n
    live = set()  # workers that may still take samples (not abandoned, not finished)
    state = {"next": 0}
    caller_state = _caller_torch_state()

    def worker() -> None:
        me = threading.current_thread()
        try:
            try:
                caller_state()
            except Exception as e:  # noqa: BLE001 - best effort: the reward still runs, with torch's defaults
                log.warning("could not give a reward worker the caller's grad mode / CUDA device: %s", e)
            while True:
                with cond:
                    if me not in live or state["next"] >= n:
                        return
                    i = state["next"]
                    state["next"] += 1
                    started[i] = time.monotonic()
                    owner[i] = me
                try:
                    out = _run_one(fn, i)
                except KeyboardInterrupt as e:  # in a worker thread it cannot stop the run: report it
                    out = Outcome("error", e)
                with cond:
                    if outcomes[i] is None:
                        outcomes[i] = out
                    cond.notify_all()
        except RewardCancelled:
            return
        finally:
            with cond:
                live.discard(me)
                cond.notify_all()

    def top_up() -> None:
        # Keep `concurrency` workers while samples remain unstarted (replacing abandoned ones).
        while len(live) < min(concurrency, n - state["next"]):
            t = threading.Thread(target=worker, name="reward-worker", daemon=True)
            live.add(t)
            t.start()

    with cond:
        top_up()
        while True:
            now = time.monotonic()
            wait = poll_interval
            pending = False
            for i in range(n):
                if outcomes[i] is not None:
                    continue
                pending = True
                if started[i] is None:
                    continue
                if not owner[i].is_alive():  # its worker died without a result (should not happen)
                    outcomes[i] = Outcome("error", RuntimeError("reward worker thread died"))
                    continue
                if timeout is None:
                    continue
                left = started[i] + timeout - now
                if left > 0:
                    wait = min(wait, left)
                    continue
                outcomes[i] = Outcome("timeout", RewardTimeoutError(f"timed out after {timeout:g}s"))
                live.discard(owner[i])
                _cancel_thread(owner[i])
            if not pending:
                break
            top_up()
            cond.wait(timeout=max(wait, 0.001))
    return [o for o in outcomes]  # type: ignore[misc]


def call_with_timeout(fn: Callable[[], Any], timeout: Optional[float]) -> Outcome:
    """Runs ``fn()`` (resolving an awaitable result) with an overall time limit.

    Without a timeout it runs in the calling thread; with one, in a daemon thread that is cancelled (best
    effort, see the module docstring) when the limit passes.

    Args:
        fn (Callable[[], Any]): the call.
        timeout (Optional[float]): seconds. Default is None (no limit).

    Returns:
        Outcome: ``("ok", value)``, ``("error", exception)`` or ``("timeout", RewardTimeoutError)``.
    """
    return run_each(lambda _: fn(), 1, timeout=timeout, concurrency=1)[0]
