"""Save on SIGTERM: a preempted run keeps the steps it trained since its last periodic checkpoint.

Cluster schedulers (SLURM, Kubernetes) send SIGTERM before they kill a job, and ``torchrun`` forwards it to
every worker. With ``save_on_sigterm: True`` (the default) the first SIGTERM does not stop the process: it
sets a flag; at the end of the current step the ranks agree (one all-reduce of the flag, so a signal that
reached only some ranks still stops all of them at the same step), save a checkpoint exactly as a periodic
save does (staging directory, then rename) and stop with exit code 143 (128 + SIGTERM). A second SIGTERM
stops the process at once, as if no handler were installed.

The save has to finish before the scheduler's kill: ``torchrun`` sends SIGKILL 30 s after its SIGTERM (SLURM:
``KillWait``; ask for an earlier warning with ``sbatch --signal=TERM@120``). A save cut short by the kill
leaves the previous checkpoints intact (torchtune_grpo/checkpoints/storage.py).
"""

import logging
import os
import signal
import threading
from typing import Any, Callable, List

__all__ = ["SIGTERM_EXIT_CODE", "StopOnSigterm"]

log = logging.getLogger(__name__)

#: The exit code of a run stopped by SIGTERM after its save, as a shell reports a process killed by it.
SIGTERM_EXIT_CODE = 128 + int(signal.SIGTERM)


class StopOnSigterm:
    """A SIGTERM flag that the training loop checks at step boundaries.

    Args:
        enabled (bool): install the handler (``save_on_sigterm``). When False, SIGTERM keeps its default
            action and :meth:`agreed` is always False.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self.requested = False  # this process received SIGTERM
        self.stopped = False  # the run stopped (and saved) because of it
        self._previous: Any = None

    def install(self) -> None:
        """Catch SIGTERM from now on (only the main thread can install handlers; elsewhere nothing is done)."""
        if not self.enabled or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def restore(self) -> None:
        """Give SIGTERM back its previous handler."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.requested:  # the second one: stop now
            self.restore()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self.requested = True
        log.warning("SIGTERM received: the run saves a checkpoint after the current step and stops "
                    "(send SIGTERM again to stop at once, without saving).")

    def agreed(self, all_reduce_sum: Callable[[List[float]], List[float]]) -> bool:
        """Whether any rank received SIGTERM; every rank must call it at the same point (a collective).

        Args:
            all_reduce_sum (Callable[[List[float]], List[float]]): sums a list of floats over all ranks.
        """
        if not self.enabled:
            return False
        return all_reduce_sum([float(self.requested)])[0] > 0
