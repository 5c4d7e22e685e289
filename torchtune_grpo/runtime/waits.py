"""Long waits that say what they wait for, so that no wait of the run is silent for more than half a minute.

A run waits on things it does not control: a vLLM server starting, a generation worker answering or
connecting, a reward still scoring. Each such wait holds a :class:`WaitReport` and calls it in its loop (or
runs it on a thread with :meth:`WaitReport.watch` when the wait is one blocking call): every
:data:`REPORT_EVERY` seconds it logs what is awaited, for how long so far, and the limit.
"""

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from torchtune import utils

__all__ = ["REPORT_EVERY", "WaitReport"]

log = utils.get_logger("INFO")

REPORT_EVERY = 30.0  # seconds between two reports of one wait


class WaitReport:
    """Logs every ``every`` seconds that a wait is still going on.

    Args:
        what (str): what is awaited, as it reads after "waiting for" (``"the vLLM server at 127.0.0.1:8000"``).
        limit (Optional[float]): the wait's limit in seconds, said with each report (and the config key that
            sets it, in ``limit_key``). None: no limit. Default is None.
        limit_key (str): the config key of the limit. Default is "".
        every (Optional[float]): seconds between reports. Default is :data:`REPORT_EVERY` (read at each
            construction, so a test may change it).
        say (Optional[Callable[[str], None]]): where reports go. Default is this module's logger (info).
        clock (Callable[[], float]): the time source. Default is ``time.monotonic``.
    """

    def __init__(
        self, what: str, *, limit: Optional[float] = None, limit_key: str = "", every: Optional[float] = None,
        say: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.limit, self.limit_key = what, limit, limit_key
        self.every = REPORT_EVERY if every is None else float(every)
        self.say = say if say is not None else log.info
        self.clock = clock
        self.start = clock()
        self._next = self.start + self.every

    @property
    def waited(self) -> float:
        """Seconds since the wait began."""
        return self.clock() - self.start

    def message(self) -> str:
        """The report: what, how long so far, and the limit."""
        limit = "no limit" if self.limit is None else f"limit {self.limit:g} s"
        if self.limit_key:
            limit += f", {self.limit_key}"
        return f"still waiting for {self.what}: {self.waited:.0f} s so far ({limit})"

    def __call__(self) -> None:
        """Report if ``every`` seconds have passed since the last report (call it in the wait's loop)."""
        now = self.clock()
        if now >= self._next:
            self.say(self.message())
            # The next report is ``every`` after this one, not after the missed ticks of a long blocking call.
            self._next = now + self.every

    @contextmanager
    def watch(self) -> Iterator["WaitReport"]:
        """Report from a thread of its own while the block runs (for a wait that is one blocking call)."""
        done = threading.Event()

        def run() -> None:
            while not done.wait(max(0.0, self._next - self.clock())):
                self()

        thread = threading.Thread(target=run, name="grpo-wait-report", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            done.set()
            thread.join()
